"""One bad request never harms another (engine level): atomic forks, per-request failure, no stuck
sequence, no leaked cache, and the good requests' tokens unchanged by the bad ones."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve import LLM, SamplingParams
from hybridserve.engine import fork, sampler
from hybridserve.engine.sequence import Sequence
from tests.checkpoints import make
from tests.faults import MARK, poison_marked_rows
from tests.prefix_utils import released_everything

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make(str(tmp_path_factory.mktemp("isolation")), "bamba")


def _prompts(n: int, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(length),), generator=g).tolist()
            for length in torch.randint(1, 40, (n,), generator=g)]


def _gen(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _assert_idle(llm: LLM) -> None:
    """Nothing runs, waits or holds cache, and the engine keeps no request."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert len(engine._requests) == 0
    assert released_everything(engine)


def test_seed_overflow_of_a_fork_is_refused_up_front():
    """The reproduction: n=3 with seed 2**64-2 (child 2 would overflow) is a clear ValueError, holds
    nothing, and the LLM keeps working."""
    llm = LLM(max_model_len=128, cache_memory="2MiB")
    with pytest.raises(ValueError, match=r"seed=18446744073709551614 .*18446744073709551613"):
        llm.generate(["Hi"], SamplingParams(n=3, seed=2 ** 64 - 2, max_tokens=5))
    _assert_idle(llm)
    out = llm.generate(["Hi"], SamplingParams(n=3, seed=2 ** 64 - 3, max_tokens=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(c.finish_reason for c in out.outputs)
    _assert_idle(llm)


def test_params_changed_after_creation_are_checked_again(path):
    llm = LLM(path, cache_memory="8MiB")
    params = SamplingParams(n=2, seed=5, max_tokens=4)
    params.seed = 2 ** 64 - 1  # seed + 1 overflows
    with pytest.raises(ValueError, match="seed"):
        _gen(llm, [[5, 6, 7]], params)
    _assert_idle(llm)


def test_a_bad_prompt_among_many_queues_none(path):
    llm = LLM(path, cache_memory="8MiB", max_model_len=64)
    with pytest.raises(ValueError, match="prompt 2: prompt of 70 tokens"):
        _gen(llm, [[5], [6, 7], [8] * 70], GREEDY)
    _assert_idle(llm)


def test_a_failing_fork_fails_only_its_request(path, monkeypatch):
    """Child creation that raises part-way (the third child) fails its own request and leaves no
    child behind; a concurrent request's tokens are those of a plain run."""
    prompts = _prompts(3)
    plain = [o.outputs[0].token_ids for o in _gen(LLM(path, cache_memory="8MiB"), prompts[1:], GREEDY)]
    real = fork.Sequence

    def flaky(*args, index=0, **kwargs):
        if index == 2 and args[2].temperature == MARK:
            raise RuntimeError("injected: child 2 cannot be made")
        return real(*args, index=index, **kwargs)

    monkeypatch.setattr(fork, "Sequence", flaky)
    llm = LLM(path, cache_memory="8MiB")
    outs = _gen(llm, prompts, [SamplingParams(n=4, temperature=MARK, seed=1, max_tokens=8), GREEDY, GREEDY])
    assert outs[0].finished and "child 2 cannot be made" in outs[0].error
    assert [c.finish_reason for c in outs[0].outputs] == ["error"]  # the parent only: no child was placed
    assert [o.outputs[0].token_ids for o in outs[1:]] == plain and all(o.error is None for o in outs[1:])
    _assert_idle(llm)


def test_abort_finds_every_child(path):
    llm = LLM(path, cache_memory="8MiB", max_num_seqs=3)  # some children run, the others wait
    engine = llm.engine
    engine.add_request("r", [5, 6, 7], SamplingParams(n=6, seed=3, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine._requests.seqs("r")) == 6
    assert engine.scheduler.running and engine.scheduler.waiting
    engine.abort_request("r")
    _assert_idle(llm)


def test_tiny_temperature_is_greedy(path):
    """temperature=1e-40 (its logits / T overflow float32) samples greedily instead of failing."""
    llm = LLM(path, cache_memory="8MiB")
    prompts = _prompts(2)
    greedy = [o.outputs[0].token_ids for o in _gen(llm, prompts, GREEDY)]
    tiny = _gen(llm, prompts, SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in tiny] == greedy and all(o.error is None for o in tiny)
    _assert_idle(llm)


def test_a_non_finite_distribution_fails_only_its_row(path, monkeypatch):
    """Logits that turn into nan for one request's row fail that request; a concurrent seeded
    request samples exactly the tokens it samples alone."""
    good = SamplingParams(temperature=0.9, seed=42, max_tokens=8, ignore_eos=True)
    prompts = _prompts(2, seed=4)
    alone = _gen(LLM(path, cache_memory="8MiB"), prompts[1:], good)[0].outputs[0].token_ids
    poison_marked_rows(monkeypatch, float("nan"))
    llm = LLM(path, cache_memory="8MiB")
    outs = _gen(llm, prompts, [SamplingParams(temperature=MARK, max_tokens=8), good])
    assert "not finite" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and outs[1].outputs[0].token_ids == alone
    _assert_idle(llm)


def test_a_sampler_exception_is_pinned_to_its_row(path, monkeypatch):
    """The batched sampler raising makes the engine sample each row alone: only the row that raises
    alone fails."""
    real = sampler.sample

    def raising(logits, params, *args, **kwargs):
        if any(p.temperature == MARK for p in params):
            raise RuntimeError("injected sampler failure")
        return real(logits, params, *args, **kwargs)

    prompts = _prompts(3, seed=6)
    plain = [o.outputs[0].token_ids for o in _gen(LLM(path, cache_memory="8MiB"), prompts[1:], GREEDY)]
    monkeypatch.setattr(sampler, "sample", raising)
    monkeypatch.setattr("hybridserve.engine.output_processor.sample", raising)
    llm = LLM(path, cache_memory="8MiB")
    outs = _gen(llm, prompts, [SamplingParams(temperature=MARK, max_tokens=8), GREEDY, GREEDY])
    assert "injected sampler failure" in outs[0].error
    assert [o.outputs[0].token_ids for o in outs[1:]] == plain
    _assert_idle(llm)


def _failing_forward(llm: LLM, bad) -> None:
    """Make the model step raise whenever a scheduled sequence satisfies ``bad``."""
    runner = llm.engine.runner
    real = runner.run

    def run(scheduled):
        if any(bad(item.seq, len(scheduled)) for item in scheduled):
            raise RuntimeError("injected forward failure")
        return real(scheduled)

    runner.run = run


def test_a_failing_forward_is_pinned_to_its_request(path):
    """A forward that fails whenever one request is in the batch: the batch is preempted, each member
    rerun alone; the culprit fails, the others produce the tokens of a plain run (recompute is exact)."""
    prompts = _prompts(4, seed=8)
    plain = [o.outputs[0].token_ids for o in _gen(LLM(path, cache_memory="8MiB"), prompts, GREEDY)]
    llm = LLM(path, cache_memory="8MiB")
    culprit = prompts[2]
    _failing_forward(llm, lambda seq, size: seq.prompt_token_ids == culprit and seq.num_tokens > len(culprit) + 2)
    outs = _gen(llm, prompts, GREEDY)
    assert "injected forward failure" in outs[2].error and outs[2].outputs[0].finish_reason == "error"
    assert len(outs[2].outputs[0].token_ids) == 3  # it got as far as the failure
    for i in (0, 1, 3):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == plain[i]
    _assert_idle(llm)


def test_a_failure_that_needs_a_batch_still_ends(path):
    """A forward that fails for any batch of two or more (never alone) cannot be pinned on anyone: each
    sequence fails after a bounded number of failed steps, nothing is left stuck or held."""
    llm = LLM(path, cache_memory="8MiB")
    _failing_forward(llm, lambda seq, size: size >= 2)
    outs = _gen(llm, _prompts(3, seed=9), GREEDY)
    assert all(o.finished for o in outs)
    assert all(o.error is None or "injected forward failure" in o.error for o in outs)
    _assert_idle(llm)


def test_a_sequence_with_nothing_to_compute_is_never_scheduled(path):
    """A running sequence with no pending token (the state a half-made fork used to leave) fails its
    request instead of being scheduled with 0 tokens for ever."""
    llm = LLM(path, cache_memory="8MiB")
    engine = llm.engine
    engine.add_request("good", [5, 6, 7], GREEDY)
    broken = Sequence("broken", [9, 10], GREEDY, 99)
    engine._requests.add(broken)
    assert engine.cache.grant(broken, 2)
    broken.num_computed_tokens = 2
    engine.scheduler.admit_running(broken)
    done = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert "nothing to compute" in done["broken"].error
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 8
    _assert_idle(llm)


def test_many_children_scale(path):
    """n=2000 forks, samples and finishes (the registry counts finished sequences; no per-step scan)."""
    llm = LLM(path, cache_memory="32MiB", max_num_seqs=256, max_num_batched_tokens=512)
    out = _gen(llm, [[5, 6, 7]], SamplingParams(n=2000, seed=0, max_tokens=2, ignore_eos=True))[0]
    assert sorted(c.index for c in out.outputs) == list(range(2000))
    assert all(len(c.token_ids) == 2 and c.finish_reason == "length" for c in out.outputs)
    _assert_idle(llm)


# ----------------------------------------------------------------------- random mixes
BAD_SEED = 2 ** 64 - 1
HUGE_N = 24  # far more completions than max_num_seqs: most children queue and prefill themselves


@st.composite
def request_mixes(draw):
    """Requests (good and bad) and, per step, which requests to abort."""
    kinds = draw(st.lists(st.sampled_from(["greedy", "seeded", "fork", "huge_n", "tiny_temp", "bad_seed", "poisoned",
                                           "too_long", "abort"]), min_size=2, max_size=8))
    lengths = draw(st.lists(st.integers(1, 30), min_size=len(kinds), max_size=len(kinds)))
    abort_steps = draw(st.lists(st.integers(0, 12), min_size=len(kinds), max_size=len(kinds)))
    return list(zip(kinds, lengths, abort_steps))


def _params_of(kind: str, i: int) -> SamplingParams | None:
    if kind == "bad_seed":
        return None  # SamplingParams itself refuses it
    n = {"fork": 3, "huge_n": HUGE_N}.get(kind, 1)
    temperature = {"greedy": 0.0, "tiny_temp": 1e-30, "poisoned": MARK}.get(kind, 0.8)
    return SamplingParams(n=n, temperature=temperature, seed=i if kind != "greedy" else None,
                          max_tokens=6, ignore_eos=True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=request_mixes())
def test_random_mixes_with_bad_members(path, monkeypatch, mix):
    """Bad seeds and too-long prompts are refused at once; poisoned rows fail alone; aborts free at once;
    every good request (forks with far more completions than running sequences among them) completes
    with all its tokens; afterwards nothing runs or is held."""
    poison_marked_rows(monkeypatch, float("inf"))
    llm = _mix_llm(path)
    engine = llm.engine
    g = torch.Generator().manual_seed(len(mix))
    expected: dict[str, str] = {}
    aborts: dict[int, list[str]] = {}
    for i, (kind, length, abort_step) in enumerate(mix):
        rid = f"{kind}-{i}"
        ids = torch.randint(3, 128, (length + (100 if kind == "too_long" else 0),), generator=g).tolist()
        if kind == "bad_seed":
            with pytest.raises(ValueError, match="seed"):
                SamplingParams(n=2, seed=BAD_SEED, max_tokens=4)
            continue
        if kind == "too_long":
            with pytest.raises(ValueError, match="max_model_len"):
                engine.add_request(rid, ids, _params_of(kind, i))
            continue
        engine.add_request(rid, ids, _params_of(kind, i))
        expected[rid] = {"poisoned": "error", "abort": "abort"}.get(kind, "length")
        if kind == "abort":
            aborts.setdefault(abort_step, []).append(rid)
    finished: dict[str, object] = {}
    for step in range(2000):
        for rid in aborts.pop(step, []):
            engine.abort_request(rid)
            finished[rid] = None
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests() and not aborts:
            break
    assert not engine.has_unfinished_requests(), "a sequence is stuck"
    assert set(finished) == set(expected)
    for rid, reason in expected.items():
        out = finished[rid]
        if reason == "abort":
            continue  # aborted: no output is delivered for it (possibly finished before its abort step)
        n = {"fork": 3, "huge_n": HUGE_N}.get(rid.split("-")[0], 1)
        assert len(out.outputs) == (1 if reason == "error" else n), rid
        assert all(c.finish_reason == reason for c in out.outputs), (rid, [c.finish_reason for c in out.outputs])
        if reason == "length":
            assert all(len(c.token_ids) == 6 for c in out.outputs) and out.error is None
    _assert_idle(llm)


_MIX_LLM: dict[str, LLM] = {}


def _mix_llm(path: str) -> LLM:
    """One small engine for every example (a tight pool, so forks sometimes queue)."""
    if path not in _MIX_LLM:
        _MIX_LLM[path] = LLM(path, cache_memory="2MiB", max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=48)
    return _MIX_LLM[path]
