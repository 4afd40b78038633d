"""Per-sequence cache holdings: a KV block table and one state slot, drawn from the pool.

The manager is the owner the pool reports compaction moves to: it knows every sequence that holds
pages or a slot and rewrites their block tables and slot ids when the pool moves them.
"""

from __future__ import annotations

from typing import Protocol

from hybridserve.cache.capacity import fits, pages_for
from hybridserve.cache.pool import Allocation, CachePool, Relocation


class CacheHolder(Protocol):
    """What the manager needs of a sequence: its block table, its state slot and how many of its
    tokens are in the cache (``engine.Sequence`` is one)."""

    block_table: list[int]
    state_slot: int | None
    num_computed_tokens: int


class CacheManager:
    """Grants and releases each sequence's pages and slot; never leaks."""

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size
        self._holders: dict[int, CacheHolder] = {}  # id(seq) -> seq, for every sequence holding anything

    def pages_for(self, num_tokens: int) -> int:
        """KV pages needed to hold ``num_tokens`` tokens (0 for a model without attention)."""
        return pages_for(self.pool.layout, num_tokens)

    def needs(self, seq: CacheHolder, num_new_tokens: int) -> tuple[int, int]:
        """(pages, slots) still to be granted for ``seq`` to run ``num_new_tokens`` more tokens."""
        pages = max(0, self.pages_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        slots = 1 if self.pool.layout.has_state and seq.state_slot is None else 0
        return pages, slots

    def can_grant(self, seq: CacheHolder, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(*self.needs(seq, num_new_tokens))

    def grant(self, seq: CacheHolder, num_new_tokens: int) -> bool:
        """Grant what ``seq`` needs for ``num_new_tokens`` more tokens; False (nothing granted) if it does not fit.

        The pool may compact to make room; the moved holdings of other sequences are rewritten here.
        """
        pages, slots = self.needs(seq, num_new_tokens)
        if not pages and not slots:
            return True
        if not self.pool.can_allocate(pages, slots):
            return False
        self.allocate_for(seq, pages, slots)
        return True

    def allocate_for(self, seq: CacheHolder, pages: int, slots: int) -> Allocation:
        """Give ``seq`` ``pages`` more KV pages and, with ``slots=1``, its state slot.

        Every allocation for a sequence goes through here (never ``pool.allocate*`` directly): the pool
        may compact to make room, and the holdings of the sequences it moved are rewritten here.
        Raises :class:`~hybridserve.cache.pool.OutOfCacheError` (nothing changed) when they do not fit.
        """
        got = self.pool.allocate(pages, slots)
        if got.relocation:
            self._apply(got.relocation)
        if got.slots:
            seq.state_slot = got.slots[0]
        seq.block_table.extend(got.pages)
        self._holders[id(seq)] = seq
        return got

    def _apply(self, moves: Relocation) -> None:
        """Point every holder at its items' new ids."""
        for seq in self._holders.values():
            if moves.pages and seq.block_table:
                seq.block_table[:] = [moves.pages.get(b, b) for b in seq.block_table]
            if seq.state_slot is not None and seq.state_slot in moves.slots:
                seq.state_slot = moves.slots[seq.state_slot]

    def release(self, seq: CacheHolder) -> None:
        """Return everything ``seq`` holds to the pool."""
        if seq.block_table:
            self.pool.free_pages(seq.block_table)
            seq.block_table = []
        if seq.state_slot is not None:
            self.pool.free_slot(seq.state_slot)
            seq.state_slot = None
        self._holders.pop(id(seq), None)

    def fits_at_all(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits in a pool holding nothing else (but the
        padding reservation of captured decode steps, which stays for the pool's life)."""
        pool = self.pool
        pad_pages, pad_slots = pool.reserved_counts()
        return fits(pool.layout, pool.geometry, self.pages_for(num_tokens) + pad_pages,
                    (1 if pool.layout.has_state else 0) + pad_slots)
