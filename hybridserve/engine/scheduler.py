"""Continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hybridserve.cache.manager import CacheManager
from hybridserve.cache.prefix_sharing import MAX_COMPARED, waits_for_leader
from hybridserve.engine.fair_share import OriginLedger, starvation_victims
from hybridserve.engine.sequence import Sequence, SequenceStatus

#: at most this many queued sequences of origins over their fair share are passed over in one step to reach
#: the sequences of other origins behind them (engine/fair_share.py)
MAX_PASSED = 4096


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens run this step (1 for a decode, a chunk for a prefill)
    drafts: list[int] = field(default_factory=list)  # proposed tokens verified after them (speculation)
    draft_probs: Any = None  # (len(drafts), V) the draft model's probabilities of them, when it sampled them
    on_spec_slot: bool = False  # runs on the sequence's speculative slot (it verifies drafts)
    num_accepted: int = 0  # drafts its verification accepted (set once verified)

    @property
    def num_run(self) -> int:
        """Tokens in the forward: the step's own and its drafts."""
        return self.num_tokens + len(self.drafts)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    idle: list[Sequence] = field(default_factory=list)  # running with nothing to compute (a bug): not scheduled


class Scheduler:
    """Decides, each step, which sequences run and how many tokens each.

    Running sequences go first in arrival order (decodes, then unfinished prefill chunks), then
    waiting ones join while the token budget, ``max_num_seqs`` and the pool allow. When the pool
    cannot grow a running sequence, the most recently arrived running sequence is preempted: its
    pages and slot are released and it waits to be recomputed from its tokens.

    Slots are shared fairly between origins (``engine/fair_share.py``): a queued sequence of an origin
    that has its share while others wait is passed over, and an origin waiting with nothing running
    gets one slot from the origin running the most.

    After a failed step, the engine names its sequences ``suspects`` (preempted, so they recompute
    exactly): each then runs alone until it has caught up, so a failure that comes back is pinned to
    the one sequence that causes it. The others keep waiting meanwhile; a running sequence with
    nothing to compute is never scheduled (it is reported in ``idle``).
    """

    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.suspects: deque[Sequence] = deque()  # sequences of a failed step, to run alone one by one
        self.origins = OriginLedger()  # sequences held per origin, for the fair share of slots
        self.num_fairness_preemptions = 0  # of num_preemptions: to give a starved origin a slot

    def add(self, seq: Sequence) -> None:
        self.origins.enter(seq)
        self.waiting.append(seq)

    def has_room(self) -> bool:
        """Whether another sequence may run (fewer than ``max_num_seqs`` are running)."""
        return len(self.running) < self.max_num_seqs

    def fork_room(self, parent: Sequence) -> int:
        """How many children of ``parent`` may start running now: the free slots, within its origin's fair share
        while other origins wait."""
        free = self.max_num_seqs - len(self.running)
        if free <= 0:
            return 0
        return self.origins.view(self.running, self.max_num_seqs).room(parent.origin, free)

    def admit_running(self, seq: Sequence) -> None:
        """Put ``seq``, which already holds its cache (a forked child), straight into the running set."""
        self.origins.enter(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_running_requests(self) -> int:
        """How many requests have a running sequence (a request with ``n > 1`` counts once)."""
        return len({seq.request_id for seq in self.running})

    def sequences(self) -> list[Sequence]:
        """Every sequence it holds: the running ones, then the waiting ones in queue order."""
        return list(self.running) + list(self.waiting)

    def stalled(self) -> bool:
        """Whether requests wait while none runs (the next one found no room in an otherwise empty pool)."""
        return bool(self.waiting) and not self.running

    def suspect(self, seqs: list[Sequence]) -> None:
        """Queue ``seqs`` (those of a failed step still unfinished, oldest first) to run alone one by one."""
        self.suspects.extend(s for s in sorted(seqs, key=lambda s: s.arrival) if not s.is_finished)

    @property
    def solo(self) -> Sequence | None:
        """The suspect running alone now, if any."""
        while self.suspects and self.suspects[0].is_finished:
            self.suspects.popleft()
        return self.suspects[0] if self.suspects else None

    def cleared(self, seq: Sequence) -> None:
        """``seq``, the solo suspect, ran without failing and caught up: it rejoins the batch."""
        if self.suspects and self.suspects[0] is seq:
            self.suspects.popleft()

    def schedule(self) -> SchedulerOutput:
        solo = self.solo
        if solo is not None:
            return self._schedule_alone(solo)
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        idle: list[Sequence] = []
        share = None
        if self.waiting and len(self.running) >= self.max_num_seqs:  # full: does an origin wait with nothing running?
            share = self.origins.view(self.running, self.max_num_seqs)
            for victim in starvation_victims(share, self.running):
                self._preempt(victim)
                self.num_fairness_preemptions += 1
                preempted.append(victim)
        pool_preempted = False
        # Running sequences, oldest first; the youngest are preempted when the pool is full.
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens <= 0:
                idle.append(seq)
                i += 1
                continue
            n = self.cache.chunk(seq, min(seq.num_pending_tokens, budget))
            while not self.cache.grant(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                pool_preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        # Waiting sequences join while everything allows (not after the pool needed a preemption this step). One
        # that shares its prompt with a running one about to snapshot inside that prefix waits a step to resume
        # from it; one whose origin has its fair share while others wait is passed over.
        held_back: list[Sequence] = []  # in queue order
        num_deferred = num_passed = 0
        sharing = self.cache.prefix is not None
        while self.waiting and budget > 0 and not pool_preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if share is None:
                share = self.origins.view(self.running, self.max_num_seqs)
            if not share.room(seq.origin, 1):
                held_back.append(self.waiting.popleft())
                num_passed += 1
                if num_passed >= MAX_PASSED:
                    break
                continue
            if sharing and waits_for_leader(seq, self.running):
                held_back.append(self.waiting.popleft())
                num_deferred += 1
                if num_deferred >= MAX_COMPARED:
                    break  # a long queue of followers: the rest wait their turn unexamined
                continue
            n = self.cache.admit(seq, budget, self.waiting if sharing else ())  # resumes from a cached prefix
            if not n:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            share.took(seq.origin)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held_back))
        return SchedulerOutput(scheduled, preempted, idle)

    def _schedule_alone(self, seq: Sequence) -> SchedulerOutput:
        """Run only ``seq`` this step (preempting the youngest others if the pool needs room)."""
        preempted: list[Sequence] = []
        n = min(seq.num_pending_tokens, self.max_num_batched_tokens)
        if n <= 0:
            self.cleared(seq)
            return SchedulerOutput([], [], [seq] if seq.status == SequenceStatus.RUNNING else [])
        if seq.status == SequenceStatus.WAITING and len(self.running) >= self.max_num_seqs:
            victim = max(self.running, key=lambda s: s.arrival)  # keep at most max_num_seqs running
            self._preempt(victim)
            preempted.append(victim)
        while not self.cache.grant(seq, n):
            others = [s for s in self.running if s is not seq]
            if not others:
                return SchedulerOutput([], preempted)  # cannot fit even alone: add_request refuses such requests
            victim = max(others, key=lambda s: s.arrival)
            self._preempt(victim)
            preempted.append(victim)
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return SchedulerOutput([ScheduledSeq(seq, n)], preempted)

    def preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s cache and queue it (first) to be recomputed from its tokens."""
        if seq.status == SequenceStatus.RUNNING:
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark ``seq`` finished and release its cache, wherever it is."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._mark_finished(seq, reason, stop_reason)

    def finish_many(self, seqs: list[Sequence], reason: str) -> None:
        """Finish every sequence of ``seqs`` at once: one pass over the queues, however many there are."""
        gone = {id(seq) for seq in seqs if not seq.is_finished}
        if not gone:
            return
        self.running = [s for s in self.running if id(s) not in gone]
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        for seq in seqs:
            if id(seq) in gone:
                self._mark_finished(seq, reason, None)

    def _mark_finished(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        self.origins.leave(seq)
        self.cache.release(seq, keep_state=reason != "error")  # a failed step may have left its state half-written
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
