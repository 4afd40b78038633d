"""Stable handles for the pool's pages or slots, mapped to where their bytes are now.

Compaction (:meth:`hybridserve.cache.pool.CachePool.make_room`) moves a live page or slot to another
position in the buffer. Nothing outside the pool sees that: block tables, state slots, the prefix index,
snapshots and the reference counts all hold **handles**, which never change while held. The pool keeps
``handle -> position`` here and rewrites only this map when it moves an item (and bumps its ``epoch``).
The code that builds a step (the model runner, the captured decode steps, the MTP drafter) translates
handles to positions with one gather from :attr:`HandleMap.position_of`, in the forward's own integer
dtype, so a compaction costs the other holders nothing.

A new item gets the handle equal to its position when that handle is free, else the lowest free handle. The
map counts the live items whose handle is not their position (moved ones, and those bound beside them); while
there are none, every live handle is its position (a free position's handle is then free too, so a new item
gets it) and translating returns its input. So a step pays for the gather only while an item a compaction
moved is still held: a pool that never compacts never pays, and one that did stops paying once those go.
The maps are a torch ``int64`` tensor and numpy views of the same memory (one object each for the garbage
collector, whatever the size).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridserve.cache.id_set import IdSet


class HandleMap:
    """Handles ``[0, capacity)`` of one kind of item (pages or slots) and the position each live one is at."""

    def __init__(self, capacity: int, kind: str) -> None:
        self.capacity = capacity
        self.kind = kind  # "KV page" or "state slot", for error messages
        self.position_of = torch.arange(capacity, dtype=torch.int64)  # (capacity,) handle -> position
        self._position = self.position_of.numpy()  # the same memory, for scalar reads and numpy gathers
        self._handle_at = np.arange(capacity, dtype=np.int64)  # position -> the handle of its live item
        self._free = IdSet(capacity, range(capacity))
        self._displaced = 0  # live items whose handle is not their position

    def bind(self, position: int) -> int:
        """A handle for a new item at ``position``."""
        handle = position if position in self._free else self._free.peek()
        assert handle is not None, "more live items than positions"
        self._free.remove(handle)
        self._displaced += handle != position
        self._position[handle] = position
        self._handle_at[position] = handle
        return handle

    def unbind(self, handle: int) -> int:
        """Forget ``handle`` (its item goes back to the pool); returns the position it was at."""
        self.check(handle)
        self._free.push(handle)
        position = int(self._position[handle])
        self._displaced -= handle != position
        return position

    def check(self, handle: int) -> None:
        """Raise ``ValueError`` unless ``handle`` is held."""
        if not 0 <= handle < self.capacity or handle in self._free:
            raise ValueError(f"{self.kind} {handle} is not allocated")

    def move(self, src: int, dst: int) -> None:
        """The live item at position ``src`` is now at ``dst`` (its handle stays)."""
        handle = int(self._handle_at[src])
        self._displaced += (handle != dst) - (handle != src)
        self._position[handle] = dst
        self._handle_at[dst] = handle

    @property
    def identity(self) -> bool:
        """Whether every live handle is its own position (translating is then a no-op)."""
        return self._displaced == 0

    def position(self, handle: int) -> int:
        """Where the item of ``handle`` is now."""
        return int(self._position[handle])

    def handle_at(self, position: int) -> int:
        """The handle of the live item at ``position``."""
        return int(self._handle_at[position])

    def positions(self, handles: torch.Tensor) -> torch.Tensor:
        """handles: int64 CPU tensor of any shape -> the positions (same shape, on the CPU: the map stays in
        host memory, so a step on an accelerator gathers here and moves the result); ``handles`` itself while
        the map is the identity."""
        return handles if self.identity else self.position_of[handles]

    def kv_rows(self, rows: torch.Tensor, block_size: int) -> torch.Tensor:
        """rows: (T,) int64 KV rows in handle space (``page handle * block_size + offset``) -> the rows in the
        pool's views (``page position * block_size + offset``)."""
        if self.identity:
            return rows
        return self.position_of[rows // block_size] * block_size + rows % block_size

    def positions_np(self, handles: list[int] | np.ndarray) -> list[int] | np.ndarray:
        """handles: a list or int64 array -> the positions as an int64 numpy array (a gather, no torch call);
        ``handles`` itself while the map is the identity."""
        return handles if self.identity else self._position[np.asarray(handles, dtype=np.int64)]

    def kv_rows_np(self, rows: list[int], block_size: int) -> list[int] | np.ndarray:
        """:meth:`kv_rows` of a list, as an int64 numpy array; ``rows`` itself while the map is the identity."""
        if self.identity:
            return rows
        array = np.asarray(rows, dtype=np.int64)
        return self._position[array // block_size] * block_size + array % block_size
