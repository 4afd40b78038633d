"""Sampler semantics and end-to-end sampling options."""

import math

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.sampler import _processed_logits, sample
from tests.checkpoints import make


def _probs(logits, **kw):
    return _processed_logits(logits.clone(), [SamplingParams(**kw)]).softmax(-1)[0]


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    assert (_probs(logits, top_k=2) > 0).tolist() == [True, True, False, False, False]
    assert (_probs(logits, top_p=0.8) > 0).tolist() == [True, True, True, False, False]  # 0.5+0.25 < 0.8
    assert (_probs(logits, top_p=0.75) > 0).tolist() == [True, True, False, False, False]
    assert (_probs(logits, min_p=0.2) > 0).tolist() == [True, True, True, False, False]  # >= 0.1
    p = _probs(logits, temperature=0.5)
    expected = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]) ** 2
    assert torch.allclose(p, expected / expected.sum(), atol=1e-6)
    p = _probs(logits, top_k=3)
    assert torch.allclose(p[:3], torch.tensor([0.5, 0.25, 0.15]) / 0.9, atol=1e-6)


def test_sampling_follows_distribution_and_reports_logprobs():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, logprobs=2)] * 4000
    res = sample(logits, params, [None] * 4000, torch.Generator().manual_seed(0))
    freq = torch.bincount(torch.tensor(res.token_ids), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
    assert res.top_ids[0] == [0, 1]
    assert math.isclose(res.top_logprobs[0][0], math.log(0.6), rel_tol=1e-5)
    i = res.token_ids.index(2)
    assert res.sampled_ranks[i] == 3 and math.isclose(res.sampled_logprobs[i], math.log(0.1), rel_tol=1e-5)


def test_seeded_requests_reproduce_and_differ(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    llm = LLM(path, cache_memory="8MiB")
    prompt = {"prompt_token_ids": [7, 8, 9, 10]}

    def run(seed, crowd=0):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=20, ignore_eos=True)
        others = [{"prompt_token_ids": [11 + i, 12]} for i in range(crowd)]
        outs = llm.generate([prompt] + others, [params] + [SamplingParams(temperature=1.0, max_tokens=5)] * crowd)
        return outs[0].outputs[0].token_ids

    a, b, c = run(1), run(1, crowd=5), run(2)
    assert a == b  # same seed, same tokens, whatever else is in the batch
    assert a != c


def test_top_k_one_is_greedy_and_stop_token_ids(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    llm = LLM(path, cache_memory="8MiB")
    prompt = [{"prompt_token_ids": [20, 21, 22]}]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    topk1 = llm.generate(prompt, SamplingParams(temperature=0.9, top_k=1, max_tokens=12, ignore_eos=True,
                                                seed=4))[0].outputs[0]
    assert topk1.token_ids == greedy.token_ids
    stop_at = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert greedy.finish_reason == "length"
