"""Property tests of the both-ends pool: random interleavings of state and KV allocation and release.

Invariants checked after every operation: live extents never overlap; what the owners hold is
exactly what the pool has live (no leak, no double grant), the handles an owner holds never change,
and after compaction each owner finds its bytes where the pool's handle map says its items are now;
a new slot starts at zero; typed views stay aligned, zero-copy
views of the one buffer; an allocation is refused only when the total free bytes really cannot
hold it (no stranded memory); usage returns to zero when everything is released.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.cache.capacity import fits, max_sequences
from hybridserve.cache.layout import ALIGN, compute_layout
from hybridserve.cache.manager import CacheManager
from hybridserve.cache.pool import CachePool, OutOfCacheError
from hybridserve.cache.spec import AttentionSpec, LayerCacheSpec, StateTensorSpec
from hybridserve.engine.sequence import Sequence
from hybridserve.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def layouts(draw):
    """A random mix of attention and state layers with odd shapes and mixed dtypes."""
    specs = []
    kinds = draw(st.lists(st.sampled_from(["attention", "state", "both"]), min_size=1, max_size=4))
    if not any(k in ("state", "both") for k in kinds) and draw(st.booleans()):
        kinds.append("state")
    if not any(k in ("attention", "both") for k in kinds) and draw(st.booleans()):
        kinds.append("attention")
    kv_dtype = draw(st.sampled_from(DTYPES))
    for i, kind in enumerate(kinds):
        attention = state = None
        if kind in ("attention", "both"):
            attention = AttentionSpec(draw(st.integers(1, 3)), draw(st.sampled_from([4, 6, 8])), kv_dtype)
        if kind in ("state", "both"):
            state = tuple(StateTensorSpec(f"s{j}", tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))),
                                          draw(st.sampled_from(STATE_DTYPES)))
                          for j in range(draw(st.integers(1, 2))))
        specs.append(LayerCacheSpec(i, kind, attention, state or ()))
    return compute_layout(specs, draw(st.sampled_from([1, 2, 16, 64])))


def _pattern(item: tuple) -> int:
    kind, owner, *index = item
    return (owner * 13 + (index[0] * 5 if index else 0) + (0 if kind == "slot" else 101)) % 251 + 1


class Owners:
    """The test's own record of who holds what: handles, never rewritten (the pool moves only its map)."""

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool
        self.pages: dict[int, list[int]] = {}  # owner -> page handles
        self.slots: dict[int, int] = {}  # owner -> slot handle
        self.epoch = pool.epoch  # the pool's epoch at the last full check (it moves only with compaction)

    def page_bytes(self, handle: int) -> torch.Tensor:
        pb, b = self.pool.layout.page_bytes, self.pool.pages.position(handle)
        return self.pool.buffer[b * pb:(b + 1) * pb]

    def slot_bytes(self, handle: int) -> torch.Tensor:
        sb, s = self.pool.layout.slot_bytes, self.pool.slots.position(handle)
        return self.pool.buffer[s * sb:(s + 1) * sb]

    def allocate(self, owner: int, num_pages: int, num_slots: int) -> None:
        pool = self.pool
        feasible = fits(pool.layout, pool.geometry, pool.num_live_pages + num_pages, pool.num_live_slots + num_slots)
        if num_slots and owner in self.slots:
            return
        try:
            got = pool.allocate(num_pages, num_slots)
        except OutOfCacheError:
            assert not feasible, "refused although the free bytes can hold it: memory stranded"
            return
        assert feasible
        held = {h for t in self.pages.values() for h in t}
        assert not held & set(got.pages) and not set(self.slots.values()) & set(got.slots), "a held handle reused"
        for s in got.slots:
            assert int(self.slot_bytes(s).count_nonzero()) == 0, "a new state slot must start at zero"
            self.slots[owner] = s
            self.slot_bytes(s).fill_(_pattern(("slot", owner)))
        table = self.pages.setdefault(owner, [])
        for b in got.pages:
            self.page_bytes(b).fill_(_pattern(("page", owner, len(table))))
            table.append(b)

    def release(self, owner: int) -> None:
        if owner in self.pages:
            self.pool.free_pages(self.pages.pop(owner))
        if owner in self.slots:
            self.pool.free_slot(self.slots.pop(owner))

    def check(self, full: bool = False) -> None:
        """Cheap checks always; bytes and views after a compaction (the only time bytes move) or when asked."""
        pool = self.pool
        extents = pool.live_extents()
        for (_, end, _), (start, _, _) in itertools.pairwise(extents):
            assert end <= start, "live extents overlap"
        assert all(0 <= s and e <= pool.num_bytes for s, e, _ in extents)
        held_pages = sorted(b for t in self.pages.values() for b in t)
        positions = sorted(pool.pages.position(b) for b in held_pages)  # where the held pages are now
        assert positions == sorted(b for s, e, k in extents if k == "kv" for b in [s // pool.layout.page_bytes])
        assert sorted(pool.slots.position(s) for s in self.slots.values()) == sorted(
            s // pool.layout.slot_bytes for s, e, k in extents if k == "state")
        assert pool.live_handles() == (set(held_pages), set(self.slots.values()))
        assert len(set(held_pages)) == len(held_pages)
        assert pool.used_bytes() == (len(held_pages) * pool.layout.page_bytes
                                     + len(self.slots) * pool.layout.slot_bytes)
        if not (full or pool.epoch != self.epoch):
            return
        self.epoch = pool.epoch
        for owner, table in self.pages.items():  # bytes follow their owner through compaction
            for i, b in enumerate(table):
                assert bool((self.page_bytes(b) == _pattern(("page", owner, i))).all())
        for owner, s in self.slots.items():
            assert bool((self.slot_bytes(s) == _pattern(("slot", owner))).all())
        base = pool.buffer.data_ptr()
        assert base % ALIGN == 0
        for p in pool.layout.kv_placements + pool.layout.state_placements:
            cache = pool.layer_caches[p.layer]
            view = getattr(cache, p.name) if p in pool.layout.kv_placements else cache.state[p.name]
            assert view.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()  # zero-copy
            assert view.dtype == p.dtype
            ids, size = ((held_pages, pool.layout.page_bytes) if p in pool.layout.kv_placements
                         else (list(self.slots.values()), pool.layout.slot_bytes))
            for i in ids:
                assert view[i].data_ptr() == base + i * size + p.offset
                assert (view[i].data_ptr() - base) % ALIGN == 0


OPS = st.lists(st.tuples(st.sampled_from(["seq", "seq", "grow", "state", "kv", "fill", "release", "release"]),
                         st.integers(0, 15), st.integers(1, 6)), min_size=30, max_size=100)


@settings(max_examples=80, deadline=None)
@given(layout=layouts(), size_units=st.integers(2, 6), ops=OPS)
def test_random_interleavings_keep_invariants(layout, size_units, ops):
    unit = max(layout.page_bytes * 4, layout.slot_bytes)
    pool = CachePool(layout, size_units * unit + 3 * ALIGN, torch.device("cpu"))
    owners = Owners(pool)
    for op, owner, n in ops:
        pages = n if layout.has_kv else 0
        slots = 1 if layout.has_state else 0
        if op == "seq":  # a new sequence: its slot and its first pages together
            if owner not in owners.slots and owner not in owners.pages:
                owners.allocate(owner, pages, slots)
        elif op == "grow":  # a running sequence grows its KV
            owners.allocate(owner, pages, 0)
        elif op == "state":
            owners.allocate(owner, 0, slots)
        elif op == "kv":
            owners.allocate(owner, min(pages, 2), 0)
        elif op == "fill" and layout.has_kv:  # all the pages the free bytes can hold: compaction's case
            most = max(m for m in range(pool.num_pages + 1)
                       if fits(layout, pool.geometry, pool.num_live_pages + m, pool.num_live_slots))
            owners.allocate(owner, most, 0)
        else:
            owners.release(owner)
        owners.check()
    owners.check(full=True)
    for owner in list(set(owners.pages) | set(owners.slots)):
        owners.release(owner)
    owners.check()
    assert pool.used_bytes() == 0 and pool.usage() == 0.0
    assert pool.num_live_pages == 0 and pool.num_live_slots == 0
    # and the whole pool is usable again: as many sequences as the capacity arithmetic says
    n = max_sequences(layout, pool.num_bytes, 17)
    per_seq_pages = -(-17 // layout.block_size) if layout.has_kv else 0
    for _ in range(n):
        pool.allocate(per_seq_pages, 1 if layout.has_state else 0)
    assert not pool.can_allocate(per_seq_pages, 1 if layout.has_state else 0)


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), size_units=st.integers(3, 8), phase_len=st.integers(5, 40), seed=st.integers(0, 2**32))
def test_shifting_workload_compacts_and_keeps_invariants(layout, size_units, phase_len, seed):
    """Phases of many short requests (a slot and a page each) alternate with phases where a few
    requests grow long: the mix keeps changing, so memory freed by one kind is needed by the other
    and the pool has to compact to serve every allocation the free bytes allow."""
    unit = max(layout.page_bytes * 4, layout.slot_bytes)
    pool = CachePool(layout, size_units * unit + ALIGN, torch.device("cpu"))
    owners = Owners(pool)
    has_slot = 1 if layout.has_state else 0
    rng = random.Random(seed)
    for step in range(240):
        live = sorted(set(owners.pages) | set(owners.slots))
        short_phase = (step // phase_len) % 2 == 0
        r = rng.random()
        if r < (0.3 if short_phase else 0.1) and live:
            owners.release(rng.choice(live))
        elif short_phase or not live or not layout.has_kv:
            owners.allocate(step + 100, 1 if layout.has_kv else 0, has_slot)
        else:
            owners.allocate(rng.choice(live), rng.randint(1, 8), 0)
        owners.check()
    owners.check(full=True)
    for owner in list(set(owners.pages) | set(owners.slots)):
        owners.release(owner)
    assert pool.used_bytes() == 0 and pool.usage() == 0.0


def _bamba_like_layout(block_size: int = 16):
    specs = [LayerCacheSpec(0, "mamba2", state=(StateTensorSpec("conv", (40, 3), torch.bfloat16),
                                                StateTensorSpec("ssm", (4, 8, 16), torch.float32))),
             LayerCacheSpec(1, "attention", attention=AttentionSpec(2, 8, torch.bfloat16))]
    return compute_layout(specs, block_size)  # slot 2,304 B, page 1,024 B


def _seq(i: int) -> Sequence:
    return Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), i)


def _fill(pool: CachePool, seq: Sequence) -> dict:
    """Write a distinct byte into each of ``seq``'s pages and its slot; return what was written."""
    pb, sb = pool.layout.page_bytes, pool.layout.slot_bytes
    written = {}
    for i, handle in enumerate(seq.block_table):
        b = pool.pages.position(handle)
        pool.buffer[b * pb:(b + 1) * pb].fill_(10 + i)
        written[("page", i)] = 10 + i
    if seq.state_slot is not None:
        s = pool.slots.position(seq.state_slot)
        pool.buffer[s * sb:(s + 1) * sb].fill_(7)
        written[("slot",)] = 7
    return written


def _check_bytes(pool: CachePool, seq: Sequence, written: dict) -> None:
    pb, sb = pool.layout.page_bytes, pool.layout.slot_bytes
    for key, value in written.items():
        if key[0] == "page":
            b = pool.pages.position(seq.block_table[key[1]])
            assert bool((pool.buffer[b * pb:(b + 1) * pb] == value).all()), "a page lost its bytes when moved"
        else:
            s = pool.slots.position(seq.state_slot)
            assert bool((pool.buffer[s * sb:(s + 1) * sb] == value).all()), "a slot lost its bytes when moved"


def test_stranded_state_top_is_compacted_for_kv():
    """A live slot high up would pin the state top; compaction moves it down so KV can use the space."""
    layout = _bamba_like_layout()
    pool = CachePool(layout, 14 * layout.slot_bytes, torch.device("cpu"))
    manager = CacheManager(pool)
    seqs = [_seq(i) for i in range(9)]
    for s in seqs:
        assert manager.grant(s, 1)  # 9 slots from the bottom, 9 pages from the top
    survivor = seqs[-1]
    assert survivor.state_slot == 8 and pool.slots.position(8) == 8  # the map is the identity before a compaction
    written = _fill(pool, survivor)
    for s in seqs[:-1]:
        manager.release(s)
    # the most pages a new sequence (with its slot) can get: the pool's arithmetic, all free bytes
    n = max(n for n in range(pool.num_pages) if fits(layout, pool.geometry, 1 + n, 2))
    assert 2 * layout.slot_bytes + (1 + n + 1) * layout.page_bytes > pool.num_pages * layout.page_bytes  # all usable
    assert not pool.fits_in_place(n, 1)  # without moving, the slot at 8 strands the bytes below it
    newcomer = _seq(99)
    assert manager.grant(newcomer, n * layout.block_size)
    assert len(newcomer.block_table) == n
    assert survivor.state_slot == 8 and pool.slots.position(8) == 0  # its handle stays; the pool moved its bytes
    assert pool.slots.position(newcomer.state_slot) == 1 and pool.epoch == 1
    _check_bytes(pool, survivor, written)
    assert pool.stats["compactions"] == 1 and pool.stats["moved_bytes"] == layout.slot_bytes  # one slot moved
    manager.release(newcomer)
    manager.release(survivor)
    assert pool.used_bytes() == 0


def test_stranded_kv_bottom_is_compacted_for_state():
    """Pages live low down would pin the KV bottom; compaction lifts them so new slots fit."""
    layout = _bamba_like_layout()
    pool = CachePool(layout, 12 * layout.slot_bytes, torch.device("cpu"))
    manager = CacheManager(pool)
    longs = [_seq(0), _seq(1)]
    for s in longs:
        assert manager.grant(s, 1)
    while fits(layout, pool.geometry, pool.num_live_pages + 1, 2):  # grow both, interleaving their pages
        s = longs[pool.num_live_pages % 2]
        assert manager.grant(s, layout.block_size * (len(s.block_table) + 1))
    assert not manager.grant(longs[0], layout.block_size * (len(longs[0].block_table) + 1))
    keeper = longs[1]
    written = _fill(pool, keeper)
    manager.release(longs[0])  # every other page of the KV region is free; keeper's pages reach its bottom
    shorts = []
    while fits(layout, pool.geometry, pool.num_live_pages + 1, pool.num_live_slots + 1):
        shorts.append(_seq(10 + len(shorts)))
        assert manager.grant(shorts[-1], 1), "free bytes suffice: the pool must compact instead of refusing"
        _check_bytes(pool, keeper, written)
    assert len(shorts) >= 3 and pool.stats["compactions"] >= 1
    assert not manager.grant(_seq(50), 1)
    for s in [*shorts, keeper]:
        manager.release(s)
    assert pool.used_bytes() == 0


@pytest.mark.parametrize("kinds", ["kv", "state"])
def test_single_kind_pools(kinds):
    specs = ([LayerCacheSpec(0, "attention", attention=AttentionSpec(2, 8, torch.float16))] if kinds == "kv" else
             [LayerCacheSpec(0, "mamba2", state=(StateTensorSpec("ssm", (3, 5), torch.float32),))])
    layout = compute_layout(specs, 16)
    pool = CachePool(layout, 4096, torch.device("cpu"))
    n = max_sequences(layout, pool.num_bytes, 16)
    got = [pool.allocate(1 if kinds == "kv" else 0, 1 if kinds == "state" else 0) for _ in range(n)]
    assert len(got) == n and not pool.can_allocate(1 if kinds == "kv" else 0, 1 if kinds == "state" else 0)
