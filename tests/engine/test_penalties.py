"""Repetition, presence and frequency penalties, logit_bias and min_tokens masking, against reference
computations: HF's RepetitionPenaltyLogitsProcessor, OpenAI's penalty formula written as a plain loop, and
a greedy decode of the HF model with those adjustments applied step by step."""

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from hybridserve import LLM, SamplingParams
from hybridserve.engine.logit_adjust import LogitAdjuster, RowContext
from hybridserve.engine.sampler import sample
from tests.checkpoints import make
from tests.hf_reference import hf_model


def _reference_adjust(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                      eos: int | None) -> torch.Tensor:
    """One row (V,) adjusted the slow, obvious way: bias, min_tokens mask, HF's repetition penalty, then
    OpenAI's ``logit[t] -= count[t] * frequency + (count[t] > 0) * presence`` token by token."""
    row = logits.clone()
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    if len(output) < params.min_tokens:
        for token in list(params.stop_token_ids or []) + ([eos] if eos is not None and not params.ignore_eos else []):
            row[token] = float("-inf")
    if params.repetition_penalty != 1.0:
        processor = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        row = processor(torch.tensor([prompt + output]), row[None])[0]
    for token in set(output):
        count = output.count(token)
        row[token] -= count * params.frequency_penalty + params.presence_penalty
    return row


CASES = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=-1.5),
    dict(frequency_penalty=1.1, presence_penalty=0.4, repetition_penalty=1.2),
    dict(logit_bias={3: 5.0, 17: -100.0}),
    dict(min_tokens=4, stop_token_ids=[9]),
    dict(min_tokens=4, ignore_eos=True),
    dict(),
]


def test_adjuster_matches_reference_row_by_row():
    gen = torch.Generator().manual_seed(0)
    vocab, eos = 40, 2
    logits = torch.randn(len(CASES), vocab, generator=gen) * 3  # (N, V), positive and negative logits
    rows, expected = [], []
    for i, kw in enumerate(CASES):
        params = SamplingParams(**kw)
        prompt = torch.randint(0, vocab, (6,), generator=gen).tolist()
        output = torch.randint(0, vocab, (i % 4 + 1,), generator=gen).tolist() + [3, 3]  # repeats
        rows.append(RowContext(params, prompt, output, [eos]))
        expected.append(_reference_adjust(logits[i], params, prompt, output, eos))
    adjuster = LogitAdjuster(rows)
    got = adjuster(logits)
    assert torch.allclose(got, torch.stack(expected), atol=1e-6, rtol=0)
    assert torch.equal(got[-1], logits[-1])  # no options: untouched
    assert not torch.equal(got[0], logits[0])
    for i in range(len(CASES)):  # one row alone (the per-row fallback) gives the same row
        assert torch.allclose(adjuster.row(i)(logits[i:i + 1])[0], expected[i], atol=1e-6, rtol=0)


def test_min_tokens_mask_ends_when_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[5])
    logits = torch.zeros(1, 8)
    assert LogitAdjuster([RowContext(params, [1], [4], [2])])(logits)[0, [2, 5]].isneginf().all()
    assert not LogitAdjuster([RowContext(params, [1], [4, 4], [2])])  # two tokens out: nothing to adjust


def test_sampled_tokens_follow_the_penalized_distribution_and_report_raw_logprobs():
    raw = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    n = 6000
    params = [SamplingParams(temperature=1.0, frequency_penalty=1.0, logprobs=1)] * n
    rows = [RowContext(p, [0], [0]) for p in params]  # token 0 was generated once
    res = sample(raw.repeat(n, 1), params, [None] * n, torch.Generator().manual_seed(1), adjust=LogitAdjuster(rows))
    penalized = torch.softmax(raw - torch.tensor([1.0, 0.0, 0.0]), -1)
    freq = torch.bincount(torch.tensor(res.token_ids), minlength=3).float() / n
    assert torch.allclose(freq, penalized, atol=0.025)
    assert not torch.allclose(freq, raw.exp(), atol=0.05)
    i = res.token_ids.index(0)
    assert math.isclose(res.sampled_logprobs[i], math.log(0.5), rel_tol=1e-5)  # the model's own logprob


def test_every_token_masked_fails_the_row_not_the_batch():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    rows = [RowContext(params[0], [0], [], token_mask=lambda lg, r: lg[r].fill_(float("-inf"))),
            RowContext(params[1], [0], [])]
    res = sample(torch.randn(2, 5), params, [None, None], torch.Generator(), adjust=LogitAdjuster(rows))
    assert list(res.errors) == [0] and "masked" in res.errors[0]


@torch.inference_mode()
def _hf_adjusted_greedy(path: str, prompt: list[int], params: SamplingParams, steps: int, eos: int | None):
    model = hf_model(path)
    ids = list(prompt)
    out: list[int] = []
    raw_lps: list[float] = []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()  # (V,)
        token = int(_reference_adjust(logits, params, prompt, out, eos).argmax())
        raw_lps.append(float(torch.log_softmax(logits, -1)[token]))
        out.append(token)
        ids.append(token)
    return out, raw_lps


@pytest.mark.parametrize("family", ["bamba", "lfm2"])
def test_greedy_with_penalties_matches_hf_decoded_with_the_same_rules(ckpt_dir, family):
    path = make(ckpt_dir, family)
    llm = LLM(path, cache_memory="16MiB", enable_progress_bar=False)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19], [30, 31]]
    settings = [dict(repetition_penalty=1.5, frequency_penalty=0.5),
                dict(presence_penalty=1.0, logit_bias={40: 3.0, 41: -2.0}),
                dict()]  # a row with no adjustments in the same batch
    steps = 14
    params = [SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0, **kw) for kw in settings]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, p, out in zip(prompts, params, outs):
        ref_tokens, ref_lps = _hf_adjusted_greedy(path, prompt, p, steps, llm.engine.eos_token_id)
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, (p, completion.token_ids, ref_tokens)
        ours = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-3  # raw model logprobs, float32 noise
    plain = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))[0].outputs[0].token_ids
    assert plain != outs[0].outputs[0].token_ids  # the penalties changed the greedy path


def test_min_tokens_masks_eos_until_reached(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    llm = LLM(path, cache_memory="8MiB", enable_progress_bar=False)
    eos = llm.engine.eos_token_id
    assert eos is not None
    forced = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], forced)[0].outputs[0]
    assert eos not in out.token_ids[:5]
    assert len(out.token_ids) == 6 and out.token_ids[5] == eos and out.finish_reason == "stop"


def test_bad_penalty_values_name_the_field(ckpt_dir):
    for kw, field in [(dict(repetition_penalty=0.0), "repetition_penalty"),
                      (dict(presence_penalty=2.5), "presence_penalty"),
                      (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                      (dict(logit_bias={1: 200.0}), "logit_bias"),
                      (dict(logit_bias={"1": 2.0}), "logit_bias"),
                      (dict(logit_bias=[1]), "logit_bias")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    llm = LLM(make(ckpt_dir, "bamba"), cache_memory="8MiB", enable_progress_bar=False)
    vocab = llm.engine.hf_config.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias token ids \[%d\] are outside" % vocab):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished_requests()
