"""One sequence's grammar state: its next-token mask, the tokens it accepts, and when it is complete."""

from __future__ import annotations

from typing import Any

import torch

from hybridserve.structured_output.backend import short_error
from hybridserve.structured_output.bitmask import apply_token_bitmask, words_for


class GrammarRefusedToken(ValueError):
    """A sampled token the grammar does not allow (the mask should have excluded it)."""


class SequenceMatcher:
    """The llguidance matcher of one sequence, as a logits row's token mask (see ``RowContext.token_mask``).

    Once the grammar accepts, the request's ``stop_token_ids`` are allowed too (the model's end-of-sequence ids
    other than ``eos_token_id`` are passed among them; ``eos_token_id`` is allowed by the grammar itself); such a
    token ends the request without entering the grammar. :attr:`finished` is True when the
    grammar admits no further token: the request then ends with finish reason "stop".
    """

    def __init__(self, matcher: Any, vocab_size: int, stop_token_ids: list[int] | None = None,
                 eos_token_id: int | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_words = words_for(vocab_size)
        self.eos_token_id = eos_token_id
        self.stop_token_ids = [t for t in (stop_token_ids or []) if 0 <= t < vocab_size and t != eos_token_id]
        self.ended_by_stop_token = False

    def fill_bitmask(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into ``words`` ((W,) int32, contiguous, on the CPU)."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), self.num_words * 4)
        self._allow_stop_tokens(words)

    def _allow_stop_tokens(self, words: torch.Tensor) -> None:
        if self.stop_token_ids and self.matcher.is_accepting():
            as_bytes = words.view(torch.uint8)  # (4W,): byte m holds tokens 8m..8m+7 (little-endian words)
            for t in self.stop_token_ids:
                as_bytes[t // 8] |= 1 << (t % 8)

    def __call__(self, logits: torch.Tensor, row: int) -> None:
        """Set the disallowed tokens of ``logits[row]`` ((N, V) float) to -inf."""
        words = torch.empty(1, self.num_words, dtype=torch.int32)
        self.fill_bitmask(words[0])
        apply_token_bitmask(logits, words, [row])

    def accept(self, token: int) -> None:
        """Advance by the sampled ``token``; GrammarRefusedToken if the grammar does not allow it."""
        if token in self.stop_token_ids and self.matcher.is_accepting():
            self.ended_by_stop_token = True
            return
        if not self.matcher.consume_token(token):
            raise GrammarRefusedToken(f"structured output: the grammar does not allow token {token} here: "
                                      f"{short_error(self.matcher.get_error()) or 'no reason given'}")

    def draft_masks(self, drafts: list[int], words: torch.Tensor) -> None:
        """Fill ``words`` ((len(drafts) + 1, W) int32) with the allowed tokens after the first ``j`` drafts, row
        ``j``, for a speculative verification; the matcher ends where it began. Rows past a draft the grammar
        refuses (or past one that would end the request) are never used: they repeat the last row reached."""
        consumed = reached = 0
        for j in range(len(drafts) + 1):
            self.fill_bitmask(words[j])
            reached = j
            if j == len(drafts) or self.matcher.is_stopped():
                break
            draft = drafts[j]
            allowed = 0 <= draft < self.vocab_size and bool(int(words[j, draft // 32]) >> (draft % 32) & 1)
            if not allowed or (draft in self.stop_token_ids and self.matcher.is_accepting()):
                break
            if not self.matcher.consume_token(draft):
                break
            consumed += 1
        words[reached + 1:] = words[reached]
        if consumed:
            self.matcher.rollback(consumed)

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits no further token (EOS included once it has been taken)."""
        return self.ended_by_stop_token or self.matcher.is_stopped()


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], masks: list[SequenceMatcher]) -> None:
    """Mask rows ``rows`` of ``logits`` (N, V) float by their matchers ``masks`` in one pass: one (R, W) int32
    bitmask filled row by row in this thread (llguidance's thread pool measured slower on a 2-core CPU next to
    torch's threads; see docs/structured_output.md), then applied at once."""
    num_words = masks[0].num_words
    if any(m.num_words != num_words for m in masks):
        raise ValueError("the token masks of one batch must cover the same vocabulary")
    bitmask = torch.empty(len(masks), num_words, dtype=torch.int32)  # (R, W)
    for r, m in enumerate(masks):
        m.fill_bitmask(bitmask[r])
    apply_token_bitmask(logits, bitmask, rows)


class FixedMask:
    """One logits row's precomputed allowed tokens (a row of :meth:`SequenceMatcher.draft_masks`), usable where
    a :class:`SequenceMatcher` is (``RowContext.token_mask``)."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words  # (W,) int32
        self.num_words = words.shape[0]

    def fill_bitmask(self, words: torch.Tensor) -> None:
        words.copy_(self.words)

    def __call__(self, logits: torch.Tensor, row: int) -> None:
        apply_token_bitmask(logits, self.words[None], [row])
