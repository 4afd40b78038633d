"""Per-sequence cache holdings: a KV block table and one state slot, drawn from the pool."""

from __future__ import annotations

from hybridserve.cache.pool import CachePool
from hybridserve.engine.sequence import Sequence


class CacheManager:
    """Grants and releases each sequence's pages and slot; never leaks."""

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size

    def pages_for(self, num_tokens: int) -> int:
        """KV pages needed to hold ``num_tokens`` tokens (0 for a model without attention)."""
        if not self.pool.layout.has_kv:
            return 0
        return -(-num_tokens // self.block_size)

    def needs(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int]:
        """(pages, slots) still to be granted for ``seq`` to run ``num_new_tokens`` more tokens."""
        pages = max(0, self.pages_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        slots = 1 if self.pool.layout.has_state and seq.state_slot is None else 0
        return pages, slots

    def can_grant(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(*self.needs(seq, num_new_tokens))

    def grant(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grant what ``seq`` needs for ``num_new_tokens`` more tokens; False (nothing granted) if it does not fit."""
        pages, slots = self.needs(seq, num_new_tokens)
        if not self.pool.can_allocate(pages, slots):
            return False
        if slots:
            seq.state_slot = self.pool.allocate_slot()
        if pages:
            seq.block_table.extend(self.pool.allocate_pages(pages))
        return True

    def release(self, seq: Sequence) -> None:
        """Return everything ``seq`` holds to the pool."""
        if seq.block_table:
            self.pool.free_pages(seq.block_table)
            seq.block_table = []
        if seq.state_slot is not None:
            self.pool.free_slot(seq.state_slot)
            seq.state_slot = None

    def fits_at_all(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits in an empty pool."""
        layout = self.pool.layout
        if not layout.has_kv:
            return self.pool.num_slots >= 1
        below = -(-layout.slot_bytes // layout.page_bytes) if layout.has_state else 0  # pages under slot 0
        return self.pages_for(num_tokens) <= self.pool.num_pages - below
