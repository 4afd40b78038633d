"""Engine features against the same requests run alone: batching, chunked prefill, preemption."""

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.prefix_utils import released_everything

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (n,), generator=g).tolist()
    return [torch.randint(3, 128, (L,), generator=g).tolist() for L in lengths]


def _gen(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("family", ["bamba", "llama", "mamba2"])
def test_batch_invariance(ckpt_dir, family):
    """A request's greedy output alone equals its output among 16 others."""
    path = make(ckpt_dir, family)
    prompts = _prompts(17)
    alone = LLM(path, cache_memory="16MiB")
    target = _gen(alone, [prompts[0]])[0].outputs[0]
    crowd = LLM(path, cache_memory="16MiB", max_num_batched_tokens=64, max_num_seqs=8)
    outs = _gen(crowd, prompts)
    assert outs[0].outputs[0].token_ids == target.token_ids
    for a, b in zip(outs[0].outputs[0].logprobs, target.logprobs):
        for tid in b:
            assert abs(a[tid].logprob - b[tid].logprob) < 1e-4
    for i in (5, 11):  # a few others as well
        single = _gen(alone, [prompts[i]])[0].outputs[0].token_ids
        assert outs[i].outputs[0].token_ids == single
    assert released_everything(crowd.engine) and released_everything(alone.engine)


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_preemption_equivalence(ckpt_dir, family):
    """With a pool too small for every request at once, requests are preempted, recomputed, and
    still produce the same greedy tokens as with a roomy pool."""
    path = make(ckpt_dir, family)
    prompts = _prompts(8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(path, cache_memory="16MiB", max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in _gen(roomy, prompts, params)]
    layout = roomy.cache_layout()
    # room for roughly three sequences of ~100 tokens
    per_seq = layout["slot_bytes"] + 7 * layout["page_bytes"]
    tight = LLM(path, cache_memory=3 * per_seq + 64, max_num_seqs=8, max_num_batched_tokens=32)
    got = [o.outputs[0].token_ids for o in _gen(tight, prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert released_everything(tight.engine)


def test_state_only_model_queues_when_slots_run_out(ckpt_dir):
    """Mamba2 has no KV: a sequence's cache never grows, so a small pool means queueing, not preemption."""
    path = make(ckpt_dir, "mamba2")
    prompts = _prompts(8, seed=5)
    expected = [o.outputs[0].token_ids for o in _gen(LLM(path, cache_memory="16MiB"), prompts)]
    probe = LLM(path, cache_memory="16MiB")
    slot = probe.cache_layout()["slot_bytes"]
    tight = LLM(path, cache_memory=3 * slot + 64)
    assert tight.engine.pool.num_slots == 3
    assert [o.outputs[0].token_ids for o in _gen(tight, prompts)] == expected
    assert released_everything(tight.engine)


def test_chunk_budget_and_queueing_do_not_change_results(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    prompts = _prompts(6, seed=9)
    base = [o.outputs[0].token_ids for o in _gen(LLM(path, cache_memory="16MiB"), prompts)]
    for budget, seqs in ((7, 2), (16, 1), (33, 5)):
        llm = LLM(path, cache_memory="16MiB", max_num_batched_tokens=budget, max_num_seqs=seqs)
        assert [o.outputs[0].token_ids for o in _gen(llm, prompts)] == base, (budget, seqs)
        assert released_everything(llm.engine)


def test_outputs_in_input_order_and_abort_frees_cache(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    llm = LLM(path, cache_memory="16MiB")
    prompts = _prompts(5)
    outs = _gen(llm, prompts)
    assert [o.prompt_token_ids for o in outs] == prompts
    eng = llm.engine
    eng.add_request("x", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.cache.held_bytes() > 0
    eng.abort_request("x")
    assert released_everything(eng) and not eng.has_unfinished_requests()


def test_prompt_logprobs_match_hf(ckpt_dir):
    from tests.hf_reference import hf_model

    path = make(ckpt_dir, "bamba")
    prompt = _prompts(1, seed=11)[0] + [5, 6, 7] * 10
    llm = LLM(path, cache_memory="16MiB", max_num_batched_tokens=16)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), -1)  # (L, V)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(ref[pos - 1, tid])) < 1e-3
        top3 = set(ref[pos - 1].topk(3).indices.tolist())
        ranked = {t for t, lp in entry.items() if lp.rank is not None and lp.rank <= 3}
        assert ranked == top3
