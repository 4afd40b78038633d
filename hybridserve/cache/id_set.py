"""A set of page or slot ids with a fast smallest (or largest) member, stored as one byte per id.

The pool keeps four of them (free and live pages, free and live slots) over every id it has: millions
for a large pool of small pages. Held as Python ints in a list or set, those ids are objects the
garbage collector traverses on every full collection (0.6 s for a 5.6M-page pool, a pause in the
middle of a decode step); a ``bytearray`` is one untracked object whatever its length, and its
``find``/``rfind`` scan (``memchr``) finds the next member at memory speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

_MEMBER = 1


class IdSet:
    """Ids in ``[0, capacity)``; ``peek``/``pop`` give the smallest, or the largest with ``largest_first``.

    ``_hint`` bounds the extreme member: every member is at or above it (at or below it when
    ``largest_first``), so a ``peek`` scans only from there; adding a member past it moves it, and a
    scan moves it up to the member found, so scans cost amortized O(1) bytes per removal.
    """

    def __init__(self, capacity: int, members: Iterable[int] = (), largest_first: bool = False) -> None:
        self.capacity = capacity
        self.largest_first = largest_first
        self._bits = bytearray(capacity)  # 1 where the id is a member
        self._count = 0
        self._hint = capacity - 1 if largest_first else 0
        if isinstance(members, range) and members.step == 1 and 0 <= members.start <= members.stop <= capacity:
            self._bits[members.start:members.stop] = b"\x01" * len(members)  # the whole pool at once
            self._count = len(members)
        else:
            for i in members:
                self.push(i)

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __contains__(self, i: int) -> bool:
        return 0 <= i < self.capacity and self._bits[i] == _MEMBER

    def __iter__(self) -> Iterator[int]:
        """The members in increasing order."""
        bits, i = self._bits, -1
        while True:
            i = bits.find(_MEMBER, i + 1)
            if i < 0:
                return
            yield i

    def push(self, i: int) -> None:
        """Add ``i`` (no change if it is a member)."""
        if not 0 <= i < self.capacity:
            raise ValueError(f"id {i} is outside [0, {self.capacity})")
        if self._bits[i] != _MEMBER:
            self._bits[i] = _MEMBER
            self._count += 1
            self._hint = max(self._hint, i) if self.largest_first else min(self._hint, i)

    def remove(self, i: int) -> None:
        """Take ``i`` out (no change if it is not a member)."""
        if i in self:
            self._bits[i] = 0
            self._count -= 1

    def peek(self) -> int | None:
        """The smallest member (the largest with ``largest_first``), or None when empty."""
        if not self._count:
            return None
        if self.largest_first:
            found = self._bits.rfind(_MEMBER, 0, self._hint + 1)
        else:
            found = self._bits.find(_MEMBER, self._hint)
        assert found >= 0, "an IdSet's hint passed a member"
        self._hint = found
        return found

    def pop(self) -> int:
        """Take out and return the member :meth:`peek` gives; the set must not be empty."""
        top = self.peek()
        if top is None:
            raise KeyError("pop from an empty IdSet")
        self._bits[top] = 0
        self._count -= 1
        return top
