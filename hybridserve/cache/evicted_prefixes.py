"""A bounded record of what the prefix cache evicted lately, so that a lookup that finds nothing can tell
"evicted" from "never cached" (:mod:`hybridserve.cache.prefix_reason`).

An entry is a page's key (:func:`~hybridserve.cache.prefix_index.chain_key`: a hash of its salt and every token
from the start through it) and, for a snapshot, the tail tokens after that page. The record holds at most
``capacity`` entries, the oldest forgotten first; it keeps hashes and tails of the salt's own keys only, and a
lookup checks the keys chained from its own salt, so it never finds another salt's entries. Two prefixes whose
keys collide would be mistaken for each other: the reason is a diagnostic, nothing is served from it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

#: entries (evicted pages and snapshots) remembered at most
MAX_EVICTED_ENTRIES = 4096

#: the tail of an entry that is a page, not a snapshot
PAGE = None


class EvictedPrefixes:
    """Recently evicted pages and snapshots, by key; at most ``capacity`` entries."""

    def __init__(self, capacity: int = MAX_EVICTED_ENTRIES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, tuple[int, ...] | None], None] = OrderedDict()
        self._keys: Counter[int] = Counter()  # key -> entries under it

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: int, tail: tuple[int, ...] | None = PAGE) -> None:
        """Remember the page keyed ``key`` (``tail`` PAGE) or the snapshot ``tail`` tokens after it."""
        entry = (key, tail)
        if entry in self._entries:
            self._entries.move_to_end(entry)
            return
        self._entries[entry] = None
        self._keys[key] += 1
        while len(self._entries) > self.capacity:
            (old, _), _ = self._entries.popitem(last=False)
            self._keys[old] -= 1
            if not self._keys[old]:
                del self._keys[old]

    def has_page(self, key: int) -> bool:
        """Whether the page keyed ``key`` was evicted lately."""
        return (key, PAGE) in self._entries

    def has_snapshot(self, key: int, tokens: list[int], start: int, limit: int, block_size: int) -> bool:
        """Whether a snapshot hanging on the page keyed ``key`` (which ends at token ``start``), with a tail that
        ``tokens`` continue with and a position no later than ``limit``, was evicted lately."""
        if key not in self._keys:
            return False
        for length in range(min(block_size, limit - start + 1)):
            if (key, tuple(tokens[start:start + length])) in self._entries:
                return True
        return False
