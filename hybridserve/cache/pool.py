"""One byte pool for attention KV and recurrent state, carved from both ends.

The pool is a single ``uint8`` buffer. It is viewed two ways at once:

* as an array of **KV pages** of ``page_bytes`` (page ``b`` at byte ``b * page_bytes``), each
  holding ``block_size`` tokens of K/V for all attention layers;
* as an array of **state slots** of ``slot_bytes`` (slot ``s`` at byte ``s * slot_bytes``), each
  holding one sequence's state for all state layers.

State slots are handed out from the bottom (lowest free id first) and KV pages from the top
(highest free id first). The two regions grow toward each other, so KV and state share one budget
with no static split: many short requests use many slots, a few long ones use many pages. A page
or slot is handed out only if its bytes overlap nothing live of the other kind. Each typed
tensor is a zero-copy ``as_strided`` view of its own dtype into the buffer, aligned to 64 bytes
(see :mod:`hybridserve.cache.layout`). A slot's bytes are zeroed when it is handed out.

The only waste is the alignment padding inside a page or slot and the sliver between the two
regions that fits neither a page nor a slot.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from hybridserve.cache.layout import ALIGN, PoolLayout, TensorPlacement, align_up
from hybridserve.cache.spec import dtype_size


class OutOfCacheError(RuntimeError):
    """Raised when the pool cannot hold what was asked for."""


class _IdHeap:
    """Ids kept in a heap with lazy deletion: fast min (or max) over a changing set."""

    def __init__(self, ids: range | list[int], largest_first: bool) -> None:
        self._sign = -1 if largest_first else 1
        self._heap = [self._sign * i for i in ids]
        heapq.heapify(self._heap)
        self._members = set(ids)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, i: int) -> bool:
        return i in self._members

    def push(self, i: int) -> None:
        if i not in self._members:
            self._members.add(i)
            heapq.heappush(self._heap, self._sign * i)

    def remove(self, i: int) -> None:
        self._members.discard(i)

    def peek(self) -> int | None:
        while self._heap and self._sign * self._heap[0] not in self._members:
            heapq.heappop(self._heap)
        return self._sign * self._heap[0] if self._heap else None

    def pop(self) -> int:
        top = self.peek()
        assert top is not None
        self._members.discard(top)
        heapq.heappop(self._heap)
        return top


@dataclass
class LayerCache:
    """The typed views of one layer: ``k``/``v`` pages and named state tensors."""

    k: torch.Tensor | None = None  # (num_pages, block_size, num_kv_heads, head_size)
    v: torch.Tensor | None = None
    state: dict[str, torch.Tensor] | None = None  # name -> (num_slots, *shape)
    k_scale: float = 1.0
    v_scale: float = 1.0


class CachePool:
    """The shared pool plus its page and slot allocators."""

    def __init__(self, layout: PoolLayout, num_bytes: int, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.num_bytes = num_bytes // ALIGN * ALIGN
        self.buffer = torch.zeros(self.num_bytes, dtype=torch.uint8, device=device)
        self.num_pages = self.num_bytes // layout.page_bytes if layout.has_kv else 0
        self.num_slots = self.num_bytes // layout.slot_bytes if layout.has_state else 0
        self._free_pages = _IdHeap(range(self.num_pages), largest_first=True)
        self._free_slots = _IdHeap(range(self.num_slots), largest_first=False)
        self._live_pages = _IdHeap([], largest_first=False)  # min live page id = KV region bottom
        self._live_slots = _IdHeap([], largest_first=True)  # max live slot id = state region top
        self.layer_caches: dict[int, LayerCache] = {}
        self._build_views()

    # ----------------------------------------------------------------- views
    def _view(self, placement: TensorPlacement, stride_bytes: int, count: int) -> torch.Tensor:
        esize = dtype_size(placement.dtype)
        typed = self.buffer.view(placement.dtype)  # (num_bytes / esize,)
        inner = []
        acc = 1
        for dim in reversed(placement.shape):
            inner.append(acc)
            acc *= dim
        inner.reverse()
        assert stride_bytes % esize == 0 and placement.offset % esize == 0
        return typed.as_strided((count, *placement.shape), (stride_bytes // esize, *inner),
                                placement.offset // esize)

    def _build_views(self) -> None:
        for p in self.layout.kv_placements:
            cache = self.layer_caches.setdefault(p.layer, LayerCache())
            setattr(cache, p.name, self._view(p, self.layout.page_bytes, self.num_pages))
        for p in self.layout.state_placements:
            cache = self.layer_caches.setdefault(p.layer, LayerCache())
            if cache.state is None:
                cache.state = {}
            cache.state[p.name] = self._view(p, self.layout.slot_bytes, self.num_slots)

    # ------------------------------------------------------------ boundaries
    def _state_top(self) -> int:
        """First byte above the live state region."""
        top = self._live_slots.peek()
        return 0 if top is None else (top + 1) * self.layout.slot_bytes

    def _kv_bottom(self) -> int:
        """First byte of the live KV region."""
        bottom = self._live_pages.peek()
        return self.num_bytes if bottom is None else bottom * self.layout.page_bytes

    # ------------------------------------------------------------ allocation
    def can_allocate(self, num_pages: int, num_slots: int) -> bool:
        """Whether ``num_pages`` pages and ``num_slots`` slots can be handed out together."""
        if num_pages > 0 and not self.layout.has_kv or num_slots > 0 and not self.layout.has_state:
            return False
        state_top, kv_bottom = self._state_top(), self._kv_bottom()
        if self.layout.has_state:
            slot_holes = state_top // self.layout.slot_bytes - len(self._live_slots)
            extra_slots = max(0, num_slots - slot_holes)
            new_top = state_top + extra_slots * self.layout.slot_bytes
        else:
            new_top = 0
        if self.layout.has_kv:
            page_holes = (self.num_pages - kv_bottom // self.layout.page_bytes) - len(self._live_pages)
            extra_pages = max(0, num_pages - page_holes)
            first_page = kv_bottom // self.layout.page_bytes - extra_pages  # lowest page id then live
            return first_page >= 0 and first_page * self.layout.page_bytes >= new_top
        return new_top <= self.num_bytes

    def allocate_pages(self, n: int) -> list[int]:
        """Hand out ``n`` KV pages (highest free ids first) or raise :class:`OutOfCacheError`."""
        if not self.can_allocate(n, 0):
            raise OutOfCacheError(f"cannot allocate {n} KV pages")
        pages = [self._free_pages.pop() for _ in range(n)]
        for b in pages:
            self._live_pages.push(b)
        return pages

    def free_pages(self, pages: list[int]) -> None:
        """Return KV pages to the pool."""
        for b in pages:
            if b not in self._live_pages:
                raise ValueError(f"KV page {b} is not allocated")
            self._live_pages.remove(b)
            self._free_pages.push(b)

    def allocate_slot(self) -> int:
        """Hand out one zeroed state slot (lowest free id) or raise :class:`OutOfCacheError`."""
        if not self.can_allocate(0, 1):
            raise OutOfCacheError("cannot allocate a state slot")
        s = self._free_slots.pop()
        self._live_slots.push(s)
        size = self.layout.slot_bytes
        self.buffer[s * size:(s + 1) * size].zero_()
        return s

    def free_slot(self, s: int) -> None:
        """Return a state slot to the pool."""
        if s not in self._live_slots:
            raise ValueError(f"state slot {s} is not allocated")
        self._live_slots.remove(s)
        self._free_slots.push(s)

    # ----------------------------------------------------------------- stats
    @property
    def num_live_pages(self) -> int:
        return len(self._live_pages)

    @property
    def num_live_slots(self) -> int:
        return len(self._live_slots)

    def used_bytes(self) -> int:
        """Bytes held by live pages and slots."""
        return self.num_live_pages * self.layout.page_bytes + self.num_live_slots * self.layout.slot_bytes

    def usage(self) -> float:
        """Fraction of the pool held by live pages and slots."""
        return self.used_bytes() / self.num_bytes if self.num_bytes else 0.0

    def live_extents(self) -> list[tuple[int, int, str]]:
        """Byte ranges ``(start, end, kind)`` of everything live (for checks and inspection)."""
        pb, sb = self.layout.page_bytes, self.layout.slot_bytes
        pages = [(b * pb, (b + 1) * pb, "kv") for b in sorted(self._live_pages._members)]
        slots = [(s * sb, (s + 1) * sb, "state") for s in sorted(self._live_slots._members)]
        return sorted(pages + slots)

