"""Speculative decoding in the engine: which sequences draft this step, their drafts' cache, the verdicts.

A step's drafts are attached after scheduling (:meth:`Speculator.attach`): a sequence decoding its one
pending token (prompt done, no prompt logprobs, nothing that rewrites its logits) gets up to ``k``
drafts from the proposer, pages for them, and a second state slot. Its state is copied onto that slot
and the verification runs there (``ModelRunner``), so the state slot keeps the state before the drafts.

After the forward (:meth:`Speculator.settle`): with every draft accepted, the second slot is past them all
and becomes the state slot. With one rejected, the state slot is still before the drafts: the sequence
keeps only ``num_computed_tokens`` up to there, and its next step reruns the accepted tokens (one chunk,
which also yields the next token; docs/spec_decode.md has the byte and time figures behind this choice
over keeping one state per draft position). Attention needs no rollback: a shorter context is one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hybridserve.cache.manager import CacheManager
from hybridserve.engine.scheduler import ScheduledSeq
from hybridserve.spec_decode.config import SpeculativeConfig
from hybridserve.spec_decode.ngram import NgramIndex, propose

logger = logging.getLogger(__name__)

#: drafting pauses this many steps after a poor acceptance window, doubling each time (at most MAX_COOLDOWN)
FIRST_COOLDOWN = 8
MAX_COOLDOWN = 256
#: proposals in an acceptance window
WINDOW = 2


@dataclass
class SeqSpecState:
    """One sequence's drafting: its n-gram index, acceptance in the current window, back-off."""

    ngram: NgramIndex | None = None
    window_proposed: int = 0
    window_accepted: int = 0
    window_verifications: int = 0
    cooldown: int = 0  # steps left without drafting
    next_cooldown: int = FIRST_COOLDOWN
    mtp_drafts: list[int] = field(default_factory=list)  # the MTP head's drafts for its next step
    mtp_probs: list = field(default_factory=list)  # their distributions (sampled requests)
    mtp_base: int = -1  # the token count they were drafted at (stale once it changed)


@dataclass
class SpecStats:
    """Counters since the engine started (the ``hybridserve:spec_decode_*`` metrics)."""

    num_drafts: int = 0  # verifications
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens the verifications produced (accepted drafts and the next token)
    accepted_length_counts: list[int] = field(default_factory=list)  # [a] = verifications accepting a drafts
    num_backoffs: int = 0  # times a sequence paused drafting for low acceptance

    def as_dict(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": rate,
                "mean_acceptance_length": mean, "accepted_length_counts": list(self.accepted_length_counts),
                "num_backoffs": self.num_backoffs}


class Speculator:
    """Drafts for the eligible sequences of a step, and the bookkeeping of their verdicts."""

    def __init__(self, config: SpeculativeConfig, cache: CacheManager, max_model_len: int,
                 max_num_batched_tokens: int, draft_model=None, default_generator=None, mtp=None) -> None:
        """``draft_model``: the :class:`~hybridserve.spec_decode.draft_model.DraftModel` of method
        ``draft_model`` (bound to the pool); ``mtp``: the :class:`~hybridserve.spec_decode.mtp.MTPDrafter` of
        method ``mtp``; ``default_generator``: what draws for unseeded requests."""
        self.config = config
        self.draft_model = draft_model
        self.mtp = mtp
        self.default_generator = default_generator
        self.k = config.num_speculative_tokens
        self.cache = cache
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.has_state = cache.pool.layout.has_state
        self.stats = SpecStats(accepted_length_counts=[0] * (self.k + 1))
        self.batch_limit = config.max_batch_size  # the engine sets it (spec_decode/batch_limit.py)

    # ------------------------------------------------------------- drafting
    def _room(self, item: ScheduledSeq) -> int:
        """How many drafts ``item`` may take this step (0: it does not draft)."""
        if item.num_tokens != 1:
            return 0
        return self.room(item.seq, count_cooldown=True)

    def room(self, seq, count_cooldown: bool = False) -> int:
        """How many drafts ``seq`` may verify in its next step (0: it does not draft); ``count_cooldown``:
        this is that step (a step of its back-off passes)."""
        params = seq.params
        if (seq.num_pending_tokens != 1 or seq.wants_prompt_logprobs or not seq.output_token_ids
                or params.max_tokens is None or seq.is_finished):
            return 0
        state = seq.spec
        if state is not None and state.cooldown > 0:
            if count_cooldown:
                state.cooldown -= 1
            return 0
        # the verification emits up to drafts + 1 tokens: no more than the request may still take
        left = min(params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        room = min(self.k, left - 1)
        plan = [p for p in seq.snapshot_plan if p > seq.num_computed_tokens]
        if plan:  # the prefix cache snapshots there: the verification must not run past it
            room = min(room, plan[0] - seq.num_computed_tokens - 1)
        return max(0, room)

    def attach(self, scheduled: list[ScheduledSeq], num_running: int, may_draft: bool = True) -> int:
        """Give the eligible sequences of this step their drafts, with the pages and slot to verify them;
        returns how many sequences draft. A draft model also runs the step's tokens (it absorbs what the
        target absorbs), drafting or not."""
        drafting: list[tuple[ScheduledSeq, int]] = []
        if may_draft and num_running <= self.batch_limit:
            budget = self.max_num_batched_tokens - sum(item.num_tokens for item in scheduled)
            for item in scheduled:
                if budget <= 0:
                    break
                room = min(self._room(item), budget)
                if room <= 0:
                    continue
                seq = item.seq
                if seq.spec is None:
                    seq.spec = SeqSpecState(ngram=NgramIndex(self.config.prompt_lookup_min)
                                            if self.config.method == "ngram" else None)
                if self.config.method in ("ngram", "mtp"):
                    drafts, probs = self._proposal(seq, room)
                    if not drafts or not self._grant(item, len(drafts)):
                        continue
                    item.drafts, item.draft_probs, item.on_spec_slot = drafts, probs, True
                    room = len(drafts)
                else:  # the draft model drafts below, once every drafting sequence has its room
                    if not self._grant(item, room):
                        continue
                    item.on_spec_slot = True
                budget -= room
                drafting.append((item, room))
        if self.draft_model is not None:
            self.draft_model.step(scheduled, drafting, self.default_generator)
        return len(drafting)

    def _proposal(self, seq, room: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``room`` drafts of the n-gram lookup, or those the MTP head left after the last step (with
        their distributions where the request samples)."""
        if self.config.method == "ngram":
            return propose(seq.all_token_ids, seq.spec.ngram, room, self.config.prompt_lookup_max), None
        state = seq.spec
        if state.mtp_base != seq.num_tokens or not state.mtp_drafts:
            return [], None
        drafts = state.mtp_drafts[:room]
        probs = torch.stack(state.mtp_probs[:len(drafts)]) if state.mtp_probs else None
        return drafts, probs

    def after_step(self, logits) -> None:
        """With an MTP head: run it over the step's rows and leave each next-decoding sequence its drafts."""
        if self.mtp is None:
            return
        for item in logits.order:
            if item.seq.spec is None and not item.seq.is_finished:
                item.seq.spec = SeqSpecState()
        self.mtp.after_step(logits, self.room, self.default_generator)

    def _grant(self, item: ScheduledSeq, num_drafts: int) -> bool:
        """Pages for the drafts and, with recurrent state, the second slot (state copied onto it)."""
        seq = item.seq
        if not self.cache.grant(seq, item.num_tokens + num_drafts):
            return False
        if self.has_state:
            if not self.cache.grant_spec_slot(seq):
                return False
            self.cache.begin_verification(seq)
        return True

    # -------------------------------------------------------------- verdicts
    def settle(self, item: ScheduledSeq, num_accepted: int, num_emitted: int) -> None:
        """The verification of ``item`` accepted ``num_accepted`` drafts and its sequence took ``num_emitted``
        tokens of the verdict (fewer when it stopped inside it): set what its cache now holds."""
        seq = item.seq
        m = len(item.drafts)
        item.num_accepted = num_accepted
        self._record(seq, m, num_accepted, num_emitted)
        if seq.is_finished:
            return  # its cache is released
        all_accepted = num_accepted == m
        if self.has_state:
            self.cache.end_verification(seq, all_accepted)
        if not self.has_state or all_accepted:
            # the pending token and the accepted drafts are computed; the last token emitted is pending
            seq.num_computed_tokens += item.num_tokens + num_accepted
        # else: the state slot is before the drafts; the accepted ones are rerun from there

    def _record(self, seq, m: int, a: int, emitted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += m
        stats.num_accepted_tokens += a
        stats.num_emitted_tokens += emitted
        stats.accepted_length_counts[a] += 1
        state = seq.spec
        state.window_proposed += m
        state.window_accepted += a
        state.window_verifications += 1
        if state.window_verifications < WINDOW:
            return
        if state.window_accepted < self.config.acceptance_floor * state.window_proposed:
            state.cooldown = state.next_cooldown
            state.next_cooldown = min(2 * state.next_cooldown, MAX_COOLDOWN)
            stats.num_backoffs += 1
        else:
            state.next_cooldown = FIRST_COOLDOWN
        state.window_proposed = state.window_accepted = state.window_verifications = 0
