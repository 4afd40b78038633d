"""Eviction from the prefix cache: what may go (:meth:`PrefixEviction.evictable`), in which order (its value:
tokens of recompute saved per byte, times its reuse), and the giving back of an item's pages and slot.

The policy is described in :mod:`hybridserve.cache.prefix_cache`; :class:`PrefixEviction` is the part of
``PrefixCache`` that decides and carries out evictions, over the state the cache holds (declared below).
"""

from __future__ import annotations

from typing import Callable

from hybridserve.cache.evicted_prefixes import EvictedPrefixes
from hybridserve.cache.kv_events import KVEventRecorder
from hybridserve.cache.page_ledger import PageLedger
from hybridserve.cache.prefix_hit import PrefixStats
from hybridserve.cache.prefix_index import PageNode, PrefixIndex, Snapshot


class PrefixEviction:
    """Eviction of cached pages and snapshots, lowest value first (a base of ``PrefixCache``, which sets the
    attributes declared here)."""

    ledger: PageLedger
    index: PrefixIndex
    stats: PrefixStats
    events: KVEventRecorder | None
    block_size: int
    has_state: bool
    page_bytes: int
    slot_bytes: int
    _node_by_page: dict[int, PageNode]
    _tails: dict[int, list[Snapshot]]
    evicted: EvictedPrefixes  # what was evicted lately, to tell a lookup "evicted" from "never cached"

    def evictable(self, item: PageNode | Snapshot) -> bool:
        """Whether nothing but the cache holds ``item``."""
        if item.removed or item.pins:
            return False
        if isinstance(item, Snapshot):
            return True
        if item.parent is None or item.children or item.snapshots:
            return False
        if item.page is None:
            return True
        return self.ledger.count(item.page) == 1 + len(self._tails.get(item.page, ()))

    def value(self, item: PageNode | Snapshot) -> float:
        """Tokens of recompute ``item`` saves per byte, times (1 + its hits): lower is evicted first."""
        if isinstance(item, Snapshot):
            if item.slot is None:  # a KV tail alone
                return (1 + item.hits) * len(item.tail) / self.page_bytes
            return (1 + item.hits) * item.position / (self.slot_bytes + len(item.window_pages) * self.page_bytes)
        if item.page is None or self.has_state:
            return 0.0
        return (1 + item.hits) * self.block_size / self.page_bytes

    def _consider(self, item: PageNode | Snapshot) -> None:
        """Queue ``item`` for eviction if it is evictable (a node without bytes is dropped at once; a salt's
        root that holds nothing is forgotten)."""
        if isinstance(item, PageNode) and item.parent is None:
            self.index.drop_root_if_empty(item)
            return
        if not self.evictable(item):
            return
        if isinstance(item, PageNode) and item.page is None:
            self._evict(item)
            return
        self.index.push(item, self.value(item))
        if self.index.needs_rebuild():
            self.index.rebuild(self.value, self.evictable)

    def evict_for(self, num_pages: int, num_slots: int) -> bool:
        """Evict cached items, lowest value first, until ``num_pages`` pages and ``num_slots`` slots fit."""
        return self._evict_until(lambda: self.ledger.can_allocate(num_pages, num_slots))

    def _evict_until(self, done: Callable[[], bool], below: float | None = None) -> bool:
        while not done():
            victim = self.index.pop_victim(self.evictable, below)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, item: PageNode | Snapshot) -> None:
        if isinstance(item, Snapshot):
            self.evicted.add(item.node.key, item.tail)
            self.index.remove_snapshot(item)
            if item.slot is not None:
                self.ledger.free_slot(item.slot)
                self.stats.evicted_snapshots += 1
            else:
                self.stats.evicted_pages += 1
            self._drop_window(item)
            if item.tail_page is not None:
                holders = self._tails[item.tail_page]
                holders.remove(item)
                if not holders:
                    del self._tails[item.tail_page]
                node = self._node_by_page.get(item.tail_page)
                self.ledger.unref(item.tail_page)
                if node is not None:
                    self._consider(node)
            self._consider(item.node)
            return
        self.index.remove_leaf(item)
        if self.events is not None:
            self.events.removed(item)
        if item.page is not None:
            self.evicted.add(item.key)
            del self._node_by_page[item.page]
            self.ledger.unref(item.page)
            self.stats.evicted_pages += 1
        assert item.parent is not None  # (remove_leaf takes no root)
        self._consider(item.parent)

    def clear(self) -> bool:
        """Evict everything no request holds; True if the cache is empty afterwards."""
        while True:
            victims = [item for item in self.index.items() if self.evictable(item)]
            if not victims:
                break
            for item in victims:
                if self.evictable(item):
                    self._evict(item)
        return self.index.num_nodes == 0 and self.index.num_snapshots == 0

    def _drop_window(self, snap: Snapshot) -> None:
        for page in snap.window_pages:
            self.ledger.unref(page)
        snap.window_pages = []
