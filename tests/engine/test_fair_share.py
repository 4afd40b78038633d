"""The fair share of sequence slots between origins (engine/fair_share.py), stepped deterministically: a small
request arriving behind a huge one starts at once, and requests waiting together split the new slots."""

from __future__ import annotations

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.sequence import SequenceStatus
from tests.checkpoints import make
from tests.prefix_utils import released_everything

MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def engine(ckpt_dir):
    llm = LLM(make(ckpt_dir, "bamba"), cache_memory="16MiB", block_size=8, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=128, enable_progress_bar=False)
    return llm.engine


@pytest.fixture(autouse=True)
def clean(engine):
    """Each test starts from an empty engine, whatever the one before left."""
    engine.abort_all()
    yield
    engine.abort_all()


def _running(engine, request_id: str) -> int:
    return sum(seq.request_id == request_id for seq in engine.scheduler.running)


def _step_until(engine, done, limit: int) -> int:
    """Steps taken until ``done()`` (at most ``limit``; AssertionError past it)."""
    for steps in range(1, limit + 1):
        engine.step()
        if done():
            return steps
    raise AssertionError(f"not done after {limit} steps")


def _finish_all(engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests() and released_everything(engine)
    assert len(engine.scheduler.origins) == 0  # nothing left in the ledger


def test_a_small_request_behind_a_huge_one_starts_at_once(engine):
    """n=16 takes every slot when alone; a one-token request arriving then gets a slot at the next step (one of the
    huge request's sequences is preempted for it) and finishes while the huge one still runs. Before, it waited
    for the huge request's first 8 completions, then behind its 8 queued ones: ~2 x 40 steps."""
    big = SamplingParams(n=2 * MAX_NUM_SEQS, temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
    engine.add_request("big", [5, 9, 14, 3, 77, 21], big)
    _step_until(engine, lambda: _running(engine, "big") == MAX_NUM_SEQS, limit=5)
    preemptions = engine.scheduler.num_preemptions
    engine.add_request("small", [60, 61, 62], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    _step_until(engine, lambda: _running(engine, "small") == 1, limit=1)
    assert engine.scheduler.num_preemptions == preemptions + 1 == engine.scheduler.num_fairness_preemptions
    finished = {}

    def small_done() -> bool:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        return "small" in finished

    for _ in range(10):
        if small_done():
            break
    assert "small" in finished and len(finished["small"].outputs[0].token_ids) == 4
    assert _running(engine, "big") == MAX_NUM_SEQS - 1 and "big" not in finished  # the huge one still runs
    _step_until(engine, lambda: _running(engine, "big") == MAX_NUM_SEQS, limit=2)  # and takes the slot back
    _finish_all(engine)


def test_requests_waiting_together_split_the_new_slots(engine):
    """Two calls of 12 prompts each, queued together: each gets half of the 8 slots, not the first all of them;
    the prompts of one call (one origin, as LLM.generate's) still fill every slot when nobody else waits."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_requests([(f"a-{i}", [5 + i, 6, 7], params, None) for i in range(12)])
    engine.add_requests([(f"b-{i}", [40 + i, 6, 7], params, None) for i in range(12)])
    engine.step()
    running = [seq.request_id[0] for seq in engine.scheduler.running]
    assert sorted(running) == ["a"] * 4 + ["b"] * 4, running
    _finish_all(engine)
    engine.add_requests([(f"c-{i}", [5 + i, 6, 7], params, None) for i in range(12)])
    engine.step()
    assert len(engine.scheduler.running) == MAX_NUM_SEQS
    _finish_all(engine)


def test_a_fork_takes_only_its_share_while_others_wait(engine):
    """A parent forking n=8 while another request waits runs its share of the slots (the rest of its children
    queue), and the waiting request starts in the same step; alone, the same parent's children fill every slot."""
    many = SamplingParams(n=8, temperature=0.8, seed=2, max_tokens=8, ignore_eos=True)
    engine.add_request("many", [5, 9, 14, 3], many)
    engine.add_requests([(f"w-{i}", [50 + i, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          None) for i in range(6)])
    engine.step()  # the parent's prefill; it forks when it samples its first token, in this step
    ids = [seq.request_id for seq in engine.scheduler.running]
    assert ids.count("many") == MAX_NUM_SEQS // 2 and len(ids) == MAX_NUM_SEQS, ids
    waiting_children = [seq for seq in engine.scheduler.waiting if seq.request_id == "many"]
    assert len(waiting_children) == 4 and all(s.status == SequenceStatus.WAITING for s in waiting_children)
    _finish_all(engine)
    engine.add_request("many", [5, 9, 14, 3], many)
    engine.step()
    assert _running(engine, "many") == MAX_NUM_SEQS
    _finish_all(engine)
