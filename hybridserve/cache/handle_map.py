"""Stable handles for the pool's pages or slots, mapped to where their bytes are now.

Compaction (:meth:`hybridserve.cache.pool.CachePool.make_room`) moves a live page or slot to another
position in the buffer. Nothing outside the pool sees that: block tables, state slots, the prefix index,
snapshots and the reference counts all hold **handles**, which never change while held. The pool keeps
``handle -> position`` here and rewrites only this map when it moves an item (and bumps its ``epoch``).
The code that builds a step (the model runner, the captured decode steps, the MTP drafter) translates
handles to positions with one gather from :attr:`HandleMap.position_of`, in the forward's own integer
dtype, so a compaction costs the other holders nothing.

A new item gets the handle equal to its position when that handle is free (always so until the first
compaction: the map starts as the identity), else the lowest free handle. The maps are a torch ``int64``
tensor and numpy views of the same memory (one object each for the garbage collector, whatever the size).
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

    def bind(self, position: int) -> int:
        """A handle for a new item at ``position``."""
        handle = position if position in self._free else self._free.peek()
        assert handle is not None, "more live items than positions"
        self._free.remove(handle)
        self._position[handle] = position
        self._handle_at[position] = handle
        return handle

    def unbind(self, handle: int) -> int:
        """Forget ``handle`` (its item goes back to the pool); returns the position it was at."""
        self.check(handle)
        self._free.push(handle)
        return int(self._position[handle])

    def check(self, handle: int) -> None:
        """Raise ``ValueError`` unless ``handle`` is held."""
        if not 0 <= handle < self.capacity or handle in self._free:
            raise ValueError(f"{self.kind} {handle} is not allocated")

    def move(self, src: int, dst: int) -> None:
        """The live item at position ``src`` is now at ``dst`` (its handle stays)."""
        handle = int(self._handle_at[src])
        self._position[handle] = dst
        self._handle_at[dst] = handle

    def position(self, handle: int) -> int:
        """Where the item of ``handle`` is now."""
        return int(self._position[handle])

    def handle_at(self, position: int) -> int:
        """The handle of the live item at ``position``."""
        return int(self._handle_at[position])

    def positions(self, handles: torch.Tensor) -> torch.Tensor:
        """handles: int64 tensor of any shape -> the positions (same shape, on ``handles``' device)."""
        table = self.position_of if handles.device == self.position_of.device else self.position_of.to(handles.device)
        return table[handles]

    def kv_rows(self, rows: torch.Tensor, block_size: int) -> torch.Tensor:
        """rows: (T,) int64 KV rows in handle space (``page handle * block_size + offset``) -> the rows in the
        pool's views (``page position * block_size + offset``)."""
        return self.positions(rows // block_size) * block_size + rows % block_size

    def positions_np(self, handles) -> np.ndarray:
        """handles: a list or int64 array -> the positions, as an int64 numpy array (a gather, no torch call)."""
        return self._position[np.asarray(handles, dtype=np.int64)]

    def kv_rows_np(self, rows: np.ndarray, block_size: int) -> np.ndarray:
        """:meth:`kv_rows` on a numpy int64 array."""
        return self._position[rows // block_size] * block_size + rows % block_size
