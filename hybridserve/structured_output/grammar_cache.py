"""Compiled grammars kept for reuse, bounded in (estimated) bytes: least recently used dropped first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, Protocol


class SizedEntry(Protocol):
    size_bytes: int


class GrammarCache:
    """Entries by key while their estimated sizes (``entry.size_bytes``) sum to at most ``max_bytes``.

    Putting an entry evicts the least recently used ones until it fits; an entry larger than ``max_bytes`` on its
    own is not kept (its request still uses it). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        """The entry of ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: SizedEntry) -> bool:
        """Keep ``entry`` under ``key`` (replacing any), evicting as needed; False if it is too large to keep."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.size_bytes
            if entry.size_bytes > self.max_bytes:
                return False
            while self._entries and self._bytes + entry.size_bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.size_bytes
            self._entries[key] = entry
            self._bytes += entry.size_bytes
            return True

    @property
    def bytes(self) -> int:
        """The estimated bytes of the entries kept now (at most ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
