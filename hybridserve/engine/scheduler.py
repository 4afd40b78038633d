"""Continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridserve.cache.manager import CacheManager
from hybridserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens run this step (1 for a decode, a chunk for a prefill)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]


class Scheduler:
    """Decides, each step, which sequences run and how many tokens each.

    Running sequences go first in arrival order (decodes, then unfinished prefill chunks), then
    waiting ones join while the token budget, ``max_num_seqs`` and the pool allow. When the pool
    cannot grow a running sequence, the most recently arrived running sequence is preempted: its
    pages and slot are released and it waits to be recomputed from its tokens.
    """

    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_room(self) -> bool:
        """Whether another sequence may run (fewer than ``max_num_seqs`` are running)."""
        return len(self.running) < self.max_num_seqs

    def admit_running(self, seq: Sequence) -> None:
        """Put ``seq``, which already holds its cache (a forked child), straight into the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        # Running sequences, oldest first; the youngest are preempted when the pool is full.
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, budget)
            while not self.cache.grant(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        # Waiting sequences join while everything allows (not after a preemption this step).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending_tokens, budget)
            if not self.cache.grant(seq, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

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
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
