"""The reference counts of the pool's pages, one ledger for every holder.

Sequences (through :class:`~hybridserve.cache.manager.CacheManager`) and the prefix cache
(:class:`~hybridserve.cache.prefix_cache.PrefixCache`) both hold pages of the one pool: a sequence one
reference to each page of its block tables, the prefix cache one to each page it has indexed or keeps for a
snapshot. A page goes back to the pool when its last reference goes, whoever drops it. Both hold the ledger,
never each other. Everything here is a handle (:mod:`hybridserve.cache.handle_map`): it stays valid while
held, whatever the pool compacts.
"""

from __future__ import annotations

from hybridserve.cache.pool import Allocation, CachePool


def decrement_ref(refs: dict[int, int], page: int) -> bool:
    """One reference fewer to ``page`` in ``refs``; True (and the entry gone) when that was the last."""
    count = refs[page] - 1
    if count:
        refs[page] = count
        return False
    del refs[page]
    return True


class PageLedger:
    """Reference-counted pages and plain slots of one pool."""

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool
        self.refs: dict[int, int] = {}  # page handle -> references (sequences and the prefix cache)

    def can_allocate(self, num_pages: int, num_slots: int) -> bool:
        """Whether the pool can hand out that many more pages and slots (compacting if it must)."""
        return self.pool.can_allocate(num_pages, num_slots)

    def allocate(self, num_pages: int, num_slots: int) -> Allocation:
        """Pages (one reference each, the caller's) and zeroed slots from the pool."""
        got = self.pool.allocate(num_pages, num_slots)
        for page in got.pages:
            self.refs[page] = 1
        return got

    def ref(self, page: int) -> None:
        """One more reference to ``page``."""
        self.refs[page] += 1

    def unref(self, page: int) -> bool:
        """One reference fewer to ``page``; the last one returns it to the pool (True then)."""
        if decrement_ref(self.refs, page):
            self.pool.free_pages([page])
            return True
        return False

    def count(self, page: int) -> int:
        """References to ``page`` now."""
        return self.refs[page]

    def free_slot(self, slot: int) -> None:
        """Return ``slot`` to the pool (slots have one holder each: no count)."""
        self.pool.free_slot(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the state slot ``src`` onto ``dst``."""
        self.pool.copy_slot(src, dst)
