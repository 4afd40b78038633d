"""Parallel sampling (n > 1): one prefill, children forked from the parent's cache."""

from __future__ import annotations

import pytest

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.prefix_utils import released_everything

PROMPTS = [[5, 9, 14, 3, 77, 21, 8, 40, 41, 42, 43, 17, 19, 23, 29, 31, 37, 11, 13], [60, 61, 62]]


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    return LLM(make(ckpt_dir, "bamba"), cache_memory="8MiB", block_size=8, max_num_batched_tokens=64,
               enable_progress_bar=False)


def _prefilled_tokens(llm, monkeypatch) -> list[int]:
    """Wrap the runner to count prompt tokens run through the model (what a fork must not redo)."""
    counted: list[int] = []
    run = llm.engine.runner.run

    def counting(scheduled):
        counted.append(sum(min(it.num_tokens, len(it.seq.prompt_token_ids) - it.seq.num_computed_tokens)
                           for it in scheduled if it.seq.num_computed_tokens < len(it.seq.prompt_token_ids)))
        return run(scheduled)

    monkeypatch.setattr(llm.engine.runner, "run", counting)
    return counted


def _assert_pool_empty(llm) -> None:
    assert released_everything(llm.engine)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("n", [2, 4])
def test_greedy_children_equal_single_request(llm, monkeypatch, n):
    single = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    counted = _prefilled_tokens(llm, monkeypatch)
    forked = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(n=n, temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    assert sum(counted) == sum(len(p) for p in PROMPTS), "the prompt must be prefilled once, not n times"
    for one, many in zip(single, forked):
        assert many.finished and [c.index for c in many.outputs] == list(range(n))
        want = one.outputs[0]
        for c in many.outputs:
            assert c.token_ids == want.token_ids
            assert c.finish_reason == "length"
            assert [sorted(e) for e in c.logprobs] == [sorted(e) for e in want.logprobs]
            for a, b in zip(c.logprobs, want.logprobs):
                for tid in a:
                    assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-5)
    _assert_pool_empty(llm)


def test_seeded_children_differ_and_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.5, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0]
    b = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    # child i samples like a single request seeded with seed + i
    for i, c in enumerate(a.outputs):
        solo = llm.generate({"prompt_token_ids": PROMPTS[0]},
                            SamplingParams(temperature=1.5, seed=7 + i, max_tokens=8, ignore_eos=True))[0]
        assert solo.outputs[0].token_ids == c.token_ids
    _assert_pool_empty(llm)


def test_children_wait_when_no_room(ckpt_dir):
    """With max_num_seqs=1 the children cannot run beside the parent: they queue and recompute."""
    llm = LLM(make(ckpt_dir, "bamba"), cache_memory="8MiB", block_size=8, max_num_seqs=1,
              enable_progress_bar=False)
    single = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=6))[0]
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(n=3, temperature=0, max_tokens=6))[0]
    assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 3
    _assert_pool_empty(llm)


def test_abort_frees_every_child(llm):
    engine = llm.engine
    engine.add_request("fork-abort", PROMPTS[0], SamplingParams(n=3, temperature=0, max_tokens=50, ignore_eos=True))
    while True:
        outs = engine.step()
        if outs and len(outs[0].outputs) == 3:
            break
    assert engine.pool.num_live_slots - engine.cache.prefix.num_snapshots == 3  # the request's own slots
    engine.abort_request("fork-abort")
    _assert_pool_empty(llm)


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_fork_kv_only_and_state_only_models(ckpt_dir, family):
    """Llama forks only KV pages, Mamba2 only a state slot."""
    llm = LLM(make(ckpt_dir, family), cache_memory="8MiB", block_size=8, enable_progress_bar=False)
    params = dict(temperature=0, max_tokens=8, ignore_eos=True)
    single = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(**params))[0]
    forked = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(n=3, **params))[0]
    assert [c.token_ids for c in forked.outputs] == [single.outputs[0].token_ids] * 3
    _assert_pool_empty(llm)
