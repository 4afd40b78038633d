"""One byte pool for attention KV and recurrent state, carved from both ends, compacted on demand.

The pool is a single ``uint8`` buffer viewed two ways at once:

* as an array of **KV pages** of ``page_bytes`` (page ``b`` at byte ``b * page_bytes``), each
  holding ``block_size`` tokens (16 by default, at most 64) of K/V for every attention layer;
* as an array of **state slots** of ``slot_bytes`` (slot ``s`` at byte ``s * slot_bytes``), each
  holding one sequence's recurrent state for every state layer, at its exact size.

State slots are handed out from the bottom (lowest free id first) and KV pages from the top
(highest free id first); a page or slot is handed out only where its bytes overlap nothing live of
the other kind. The two regions grow toward each other, so KV and state draw on one budget with no
static split: many short requests take many slots, a few long ones take many pages. Each typed
tensor is a zero-copy ``as_strided`` view of its own dtype into the buffer, aligned to 64 bytes
(:mod:`hybridserve.cache.layout`). A slot's bytes are zeroed when it is handed out.

Why both ends rather than one page size. Attention blocks stay small whatever the state size (a
page is sized by ``block_size`` alone, never padded to a state's size), and a slot is exactly one
sequence's state (never rounded up to a multiple of pages). The only padding is 64-byte alignment
inside a page or slot (0 B for all twelve real-size families in tests/cache/real_configs.py, in
every dtype combination), a sliver of less than one page at the top of the pool, and the unfilled
tail of each sequence's last page (under 16 tokens: under 1% of a pure-attention sequence from
1,600 tokens on, far less beside a recurrent state).

Fragmentation, and why we compact. Regions recede only as far as their outermost live item. A
state slot still live high up pins the state region's top, and the freed slots below it are
unusable for KV; a KV page live low down pins the KV region's bottom the same way. Instead of
failing (which makes the scheduler preempt and recompute a whole sequence), an allocation that
fits the *total* free bytes compacts: :meth:`CachePool.make_room` moves just the live slots or pages
in the way (a ``copy_`` inside the buffer). Holders never see it: the pool hands out stable handles and
rewrites only its own handle -> position map (:mod:`hybridserve.cache.handle_map`, ``epoch`` counts the
rewrites); whoever builds a step translates handles through it. Views never change, so moving costs
nothing beyond the copy and the map entry. Hence the rule the
allocator and the planner share (:func:`hybridserve.cache.capacity.fits`): slots and pages fit
together exactly when ``slots * slot_bytes <= (num_pages - pages) * page_bytes``.

Worked example in bytes: Bamba-9B (3 attention layers, 8 KV heads of 128; 29 Mamba2 layers with
conv (8448, 3) and SSM (128, 64, 128)), bf16 weights, bf16 KV and conv state, float32 SSM state,
a 16 GiB pool (17,179,869,184 B):

* page = 16 tokens x 3 layers x (K + V) x 8 x 128 x 2 B = 196,608 B (12,288 B per token);
  87,381 pages, the top 65,536 B (less than a page) unused.
* slot = 29 x (conv 8448 x 3 x 2 B = 50,688 B + SSM 128 x 64 x 128 x 4 B = 4,194,304 B)
  = 123,104,768 B; 139 slots if there were no KV at all.
* a 4,096-token sequence holds 123,104,768 + 256 x 196,608 = 173,436,416 B, exactly its ideal
  bytes; 87,381 x 196,608 // 173,436,416 = 99 such sequences fit (ideal 99.06): 0% padding.
* fragmentation without compaction: 120 chat requests fill slots 0-119; all finish but the one in
  slot 119. Its slot pins the state top at 14,772,572,160 B, so KV could use only the top
  2,407,231,488 B (14% of the pool) and 14,649,467,392 B (85%) would sit stranded until that
  request ends. Compaction moves that one slot to slot 0: a 123 MB copy (about 50 us at H200
  bandwidth) instead of preempting requests.

Compaction runs only when an allocation fits the free bytes but not in place, and moves only the
items in the way: first the slots no page move could make room for, then either the pages below
the new state top or the slots above the KV bottom, whichever is fewer bytes; never a whole region. A
move is one ``copy_`` of a page or a slot; what it replaces is a preemption, which recomputes a
whole sequence. Because slots go lowest-first and pages highest-first, the regions stay dense on
their own: in the randomized workloads of tests/cache/test_pool.py, whose mix of short and long
requests keeps shifting, about 2% of allocations move anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.cache.capacity import fits, pool_geometry
from hybridserve.cache.conv_codec import CodedConvState
from hybridserve.cache.dtypes import is_coded_state_dtype, torch_name
from hybridserve.cache.handle_map import HandleMap
from hybridserve.cache.id_set import IdSet
from hybridserve.cache.layout import PoolLayout, TensorPlacement
from hybridserve.cache.spec import SCALE_SUFFIX, dtype_size
from hybridserve.cache.state_codec import CodedState, StateView


class OutOfCacheError(RuntimeError):
    """Raised when the pool cannot hold what was asked for."""


@dataclass
class LayerCache:
    """The typed views of one layer: ``k``/``v`` pages and named state tensors.

    ``k_scale``/``v_scale``: stored K = K / k_scale in the cache dtype, read back as stored * k_scale
    (the checkpoint's scales for an fp8 KV cache, 1.0 otherwise).
    """

    k: torch.Tensor | None = None  # (num_pages, block_size, num_kv_heads, head_size)
    v: torch.Tensor | None = None
    latent: torch.Tensor | None = None  # MLA: (num_pages, block_size, 1, latent_size), in place of k and v
    # name -> (num_slots, *shape), or for 8-bit state a CodedState (codes and bfloat16 row scales, a temporal
    # state) or a CodedConvState (codes and per-channel exponents, a conv state)
    state: dict[str, StateView] | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    window_group: bool = False  # k/v pages are the window page group's (read through the window tables)


@dataclass
class Allocation:
    """What :meth:`CachePool.allocate` handed out: page and slot handles (stable while held)."""

    pages: list[int]
    slots: list[int]


class CachePool:
    """The shared pool plus its page and slot allocators."""

    def __init__(self, layout: PoolLayout, num_bytes: int, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.geometry = pool_geometry(layout, num_bytes)
        self.num_bytes = self.geometry.num_bytes
        # Not zero-filled: a state slot is zeroed when handed out, and attention never reads KV bytes
        # past a sequence's length. On the CPU the OS then commits memory only as it is touched.
        self.buffer = torch.empty(self.num_bytes, dtype=torch.uint8, device=device)
        self.num_pages = self.geometry.num_pages
        self.num_slots = self.geometry.num_slots
        self._free_pages = IdSet(self.num_pages, range(self.num_pages), largest_first=True)
        self._free_slots = IdSet(self.num_slots, range(self.num_slots))
        self._live_pages = IdSet(self.num_pages)  # min live page id = KV region bottom
        self._live_slots = IdSet(self.num_slots, largest_first=True)  # max live slot id = state region top
        # the four sets above are over positions; everyone outside the pool holds handles (handle_map.py)
        self.pages = HandleMap(self.num_pages, "KV page")
        self.slots = HandleMap(self.num_slots, "state slot")
        self.epoch = 0  # bumped whenever compaction moves anything (a capture re-translates its tables then)
        self.layer_caches: dict[int, LayerCache] = {}
        self.stats = {"compactions": 0, "moved_bytes": 0}
        # with tensor parallelism, rank 0 records every byte move made outside a forward here, as
        # ("zero", start, nbytes) and ("copy", src_start, dst_start, nbytes), for the other ranks to replay
        self.op_log: list[tuple] | None = None
        self._build_views()

    # ----------------------------------------------------------------- views
    def _view(self, placement: TensorPlacement, stride_bytes: int, count: int) -> torch.Tensor:
        dtype = placement.dtype if isinstance(placement.dtype, torch.dtype) else getattr(torch, torch_name(
            placement.dtype))  # a name: the bfloat16 row scales of 8-bit state, say
        esize = dtype_size(dtype)
        typed = self.buffer.view(dtype)  # (num_bytes / esize,)
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
            cache.window_group = p.group == 1
        views: dict[tuple[int, str], torch.Tensor] = {}
        for p in self.layout.state_placements:
            views[p.layer, p.name] = self._view(p, self.layout.slot_bytes, self.num_slots)
        for p in self.layout.state_placements:
            cache = self.layer_caches.setdefault(p.layer, LayerCache())
            if cache.state is None:
                cache.state = {}
            if p.name.endswith(SCALE_SUFFIX) and (p.layer, p.name.removesuffix(SCALE_SUFFIX)) in views:
                continue  # the row scales of 8-bit codes: inside the codes' CodedState
            view = views[p.layer, p.name]
            scale = views.get((p.layer, p.name + SCALE_SUFFIX)) if is_coded_state_dtype(p.dtype) else None
            if scale is None:
                cache.state[p.name] = view
            elif p.exponent_scales:
                cache.state[p.name] = CodedConvState(view, scale, p.layer, p.shard_offset)
            else:
                cache.state[p.name] = CodedState(view, scale, p.layer, p.shard_offset, p.rounding == "stochastic")

    # ------------------------------------------------------------ boundaries
    def _state_top_slots(self, num_slots: int) -> int:
        """Slot count below the state region's top once ``num_slots`` more slots are handed out in place."""
        top = self._live_slots.peek()
        return max(len(self._live_slots) + num_slots, 0 if top is None else top + 1)

    def _kv_bottom_page(self, num_pages: int) -> int:
        """Lowest live page id once ``num_pages`` more pages are handed out in place (may be < 0)."""
        bottom = self._live_pages.peek()
        dense = self.num_pages - len(self._live_pages) - num_pages
        return dense if bottom is None else min(bottom, dense)

    def fits_in_place(self, num_pages: int, num_slots: int) -> bool:
        """Whether the request fits without moving anything."""
        if not self.can_allocate(num_pages, num_slots):
            return False
        if not (self.layout.has_kv and self.layout.has_state):
            return True  # one kind only: every free id is usable
        top = self._state_top_slots(num_slots) * self.layout.slot_bytes
        return top <= self._kv_bottom_page(num_pages) * self.layout.page_bytes

    # ------------------------------------------------------------ allocation
    def can_allocate(self, num_pages: int, num_slots: int) -> bool:
        """Whether ``num_pages`` more pages and ``num_slots`` more slots fit (compacting if needed)."""
        return fits(self.layout, self.geometry, len(self._live_pages) + num_pages,
                    len(self._live_slots) + num_slots)

    def allocate(self, num_pages: int, num_slots: int) -> Allocation:
        """Hand out page handles (at the highest free positions) and zeroed slot handles (at the lowest),
        compacting if needed; no handle held before changes.

        Raises :class:`OutOfCacheError` (nothing changed) when they do not fit even after compaction.
        """
        self.make_room(num_pages, num_slots)
        slots = [self._take_slot() for _ in range(num_slots)]
        pages = []
        for _ in range(num_pages):
            b = self._free_pages.pop()
            self._live_pages.push(b)
            pages.append(self.pages.bind(b))
        return Allocation(pages, slots)

    def _take_slot(self) -> int:
        s = self._free_slots.pop()
        self._live_slots.push(s)
        size = self.layout.slot_bytes
        self.buffer[s * size:(s + 1) * size].zero_()
        if self.op_log is not None:
            self.op_log.append(("zero", s * size, size))
        return self.slots.bind(s)

    def free_pages(self, pages: list[int]) -> None:
        """Return KV pages (handles) to the pool."""
        for handle in pages:
            b = self.pages.unbind(handle)
            self._live_pages.remove(b)
            self._free_pages.push(b)

    def free_slot(self, handle: int) -> None:
        """Return a state slot (handle) to the pool."""
        s = self.slots.unbind(handle)
        self._live_slots.remove(s)
        self._free_slots.push(s)

    # ------------------------------------------------------------ compaction
    def make_room(self, num_pages: int, num_slots: int) -> None:
        """Move as few live bytes as needed for the request to fit in place (handles stay; ``epoch`` counts it).

        With ``S``/``P`` live slots/pages, the request fits in place when the state top after it,
        ``T = max(S + num_slots, top live slot + 1) * slot_bytes``, is at most the KV bottom after
        it, ``B = min(lowest live page, num_pages_total - P - num_pages) * page_bytes``. Moving
        the highest live slot into the lowest free slot lowers ``T``; moving the lowest live page
        into the highest free page raises ``B``. First the slot moves without which nothing fits
        (``T`` above the densest possible ``B``), then whichever kind costs fewer bytes. Every
        item moves at most once: a slot lands below ``S`` and a page at or above ``T``, out of reach
        of later moves.
        """
        if self.fits_in_place(num_pages, num_slots):
            return
        if not self.can_allocate(num_pages, num_slots):
            raise OutOfCacheError(f"cannot allocate {num_pages} KV pages and {num_slots} state slots: "
                                  f"{self.used_bytes()} of {self.num_bytes} bytes are live")
        sb, pb = self.layout.slot_bytes, self.layout.page_bytes
        dense_bottom = (self.num_pages - len(self._live_pages) - num_pages) * pb
        # 1. slots above the densest KV bottom must move: no page move can help them
        while (top_slot := self._live_slots.peek()) is not None and (top_slot + 1) * sb > dense_bottom:
            self._move_slot()
        if not self.fits_in_place(num_pages, num_slots):
            # 2. the state top is in the KV region: lower it, or lift the pages below it
            top = self._state_top_slots(num_slots) * sb
            lowest_page = self._live_pages.peek()
            assert lowest_page is not None, "the state top reaches the KV region only when pages are live"
            bottom = lowest_page * pb
            page_cost = pb * sum(1 for b in self._live_pages if b * pb < top)
            slots_ok = (len(self._live_slots) + num_slots) * sb <= bottom
            slot_cost = sb * sum(1 for s in self._live_slots if (s + 1) * sb > bottom) if slots_ok else None
            if slot_cost is not None and slot_cost < page_cost:
                while not self.fits_in_place(num_pages, num_slots):
                    self._move_slot()
            else:
                while not self.fits_in_place(num_pages, num_slots):
                    self._move_page()
        self.stats["compactions"] += 1
        self.epoch += 1

    def _move_slot(self) -> None:
        """Move the highest live slot into the lowest free slot (always below it)."""
        src, dst = self._live_slots.peek(), self._free_slots.peek()
        assert src is not None and dst is not None and dst < src
        self._copy(src, dst, self.layout.slot_bytes)
        self._live_slots.remove(src)
        self._free_slots.push(src)
        self._free_slots.remove(dst)
        self._live_slots.push(dst)
        self.slots.move(src, dst)

    def _move_page(self) -> None:
        """Move the lowest live page into the highest free page (always above it)."""
        src, dst = self._live_pages.peek(), self._free_pages.peek()
        assert src is not None and dst is not None and dst > src
        self._copy(src, dst, self.layout.page_bytes)
        self._live_pages.remove(src)
        self._free_pages.push(src)
        self._free_pages.remove(dst)
        self._live_pages.push(dst)
        self.pages.move(src, dst)

    def _copy(self, src: int, dst: int, size: int) -> None:
        """A compaction move: row ``src`` to row ``dst`` of ``size`` bytes, counted in ``moved_bytes``."""
        self.copy_row(src, dst, size)
        self.stats["moved_bytes"] += size

    def copy_page(self, src: int, dst: int) -> None:
        """Copy the KV page of handle ``src`` onto that of ``dst``."""
        self.copy_row(self.pages.position(src), self.pages.position(dst), self.layout.page_bytes)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the state slot of handle ``src`` onto that of ``dst``."""
        self.copy_row(self.slots.position(src), self.slots.position(dst), self.layout.slot_bytes)

    def copy_row(self, src: int, dst: int, size: int) -> None:
        """Copy the page or slot at position ``src`` onto position ``dst`` (``size``: page_bytes or slot_bytes):
        one memcpy in the buffer."""
        self.buffer[dst * size:(dst + 1) * size].copy_(self.buffer[src * size:(src + 1) * size])
        if self.op_log is not None:
            self.op_log.append(("copy", src * size, dst * size, size))

    def apply_ops(self, ops: list[tuple]) -> None:
        """Replay another rank's recorded byte moves (:attr:`op_log`) on this pool, in order."""
        for op in ops:
            if op[0] == "zero":
                _, start, size = op
                self.buffer[start:start + size].zero_()
            else:
                _, src, dst, size = op
                self.buffer[dst:dst + size].copy_(self.buffer[src:src + size])

    # ----------------------------------------------------------------- stats
    @property
    def num_live_pages(self) -> int:
        """Pages held by sequences."""
        return len(self._live_pages)

    @property
    def num_live_slots(self) -> int:
        """Slots held by sequences."""
        return len(self._live_slots)

    def used_bytes(self) -> int:
        """Bytes held by sequences' pages and slots."""
        return self.num_live_pages * self.layout.page_bytes + self.num_live_slots * self.layout.slot_bytes

    def usage(self) -> float:
        """Fraction of the pool held by live pages and slots."""
        return self.used_bytes() / self.num_bytes if self.num_bytes else 0.0

    def live_handles(self) -> tuple[set[int], set[int]]:
        """The handles of every live (page, slot) (for checks)."""
        return ({self.pages.handle_at(b) for b in self._live_pages},
                {self.slots.handle_at(s) for s in self._live_slots})

    def live_extents(self) -> list[tuple[int, int, str]]:
        """Byte ranges ``(start, end, kind)`` of everything live (for checks and inspection)."""
        pb, sb = self.layout.page_bytes, self.layout.slot_bytes
        pages = [(b * pb, (b + 1) * pb, "kv") for b in sorted(self._live_pages)]
        slots = [(s * sb, (s + 1) * sb, "state") for s in sorted(self._live_slots)]
        return sorted(pages + slots)

