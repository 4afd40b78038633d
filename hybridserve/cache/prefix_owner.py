"""What the prefix cache needs of the owner of the pool's pages and slots (``cache/manager.CacheManager``):
reference counts, raw allocations, slot copies. The manager passes itself in; the prefix cache never
imports it."""

from __future__ import annotations

from typing import Protocol

from hybridserve.cache.pool import Allocation, CachePool


class PrefixCacheOwner(Protocol):
    """The owner of the pool's pages (reference-counted) and slots, as the prefix cache uses it."""

    pool: CachePool
    page_refs: dict[int, int]  # page -> references (sequences, and the prefix cache)

    def allocate_raw(self, pages: int, slots: int) -> Allocation:
        """Pages (one reference each) and slots from the pool, compaction moves applied."""
        ...

    def ref_page(self, page: int) -> None:
        """One more reference to ``page``."""
        ...

    def unref_page(self, page: int) -> None:
        """One reference fewer to ``page``; the last one returns it to the pool."""
        ...

    def free_slot(self, slot: int) -> None:
        """Return ``slot`` to the pool."""
        ...

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the state slot ``src`` onto ``dst``."""
        ...
