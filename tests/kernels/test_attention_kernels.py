"""Compiled CPU attention kernels (``hybridserve.kernels.attention``) against the plain-PyTorch
references: paged causal attention (decode groups and prefill chunks, GQA, sliding window, K/V
scales) and the KV write, over caches that are strided views of a pool with random, non-consecutive
blocks; fp8 caches and other uncovered calls are declined without side effects."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import attention
from hybridserve.ops.paged_attention import paged_attention_ref, write_kv_cache
from tests.kernels.helpers import DTYPES, assert_bits_equal, assert_within_ulps, cu, dtype_id, needs_compiler

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]  # every ISA variant this CPU runs

DECODE = dict(q_lens=(1, 1, 1, 1, 1), seq_lens=(1, 7, 13, 21, 4))
MIXED = dict(q_lens=(1, 5, 1, 9, 3), seq_lens=(9, 5, 14, 20, 3))  # full prefills, a later chunk, decodes


class KVPool:
    """K and V caches (num_blocks, bs, Hkv, Dh) carved from one buffer: per block, K then V, each
    token's heads padded to Dh + 5 elements, 9 foreign elements after every block."""

    def __init__(self, dtype, num_blocks=40, bs=4, Hkv=2, Dh=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.num_blocks, self.bs, self.Hkv, self.Dh = num_blocks, bs, Hkv, Dh
        self.per_block = 2 * bs * Hkv * (Dh + 5)
        self.raw = torch.randn(num_blocks, self.per_block + 9, generator=g).to(dtype)  # (num_blocks, row)
        self.k_cache, self.v_cache = self.views(self.raw)

    def views(self, raw):
        kv = raw[:, :self.per_block].view(self.num_blocks, 2, self.bs, self.Hkv, self.Dh + 5)[..., :self.Dh]
        return kv[:, 0], kv[:, 1]  # (num_blocks, bs, Hkv, Dh) each, same strides


class AttnCase:
    def __init__(self, act_dtype, cache_dtype, rep, q_lens, seq_lens, Hkv=2, Dh=24, bs=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.pool = KVPool(cache_dtype, bs=bs, Hkv=Hkv, Dh=Dh, seed=seed + 1)
        S, Hq = len(seq_lens), Hkv * rep
        self.Hq, self.Dh = Hq, Dh
        nblocks = [-(-L // bs) for L in seq_lens]
        width = max(nblocks) + 2
        perm = torch.randperm(self.pool.num_blocks - 1, generator=g) + 1  # block 0: a NaN poison block
        self.block_tables = torch.zeros(S, width, dtype=torch.int64)  # unused entries -> the poison block
        used = 0
        for s, n in enumerate(nblocks):
            self.block_tables[s, :n] = perm[used:used + n]
            used += n
        # Everything a kernel must not read is NaN: the poison block, positions past each sequence's
        # length in its last block, and the padding between heads.
        nan = float("nan")
        self.pool.raw[0] = nan
        for s, L in enumerate(seq_lens):
            last = int(self.block_tables[s, nblocks[s] - 1])
            self.pool.k_cache[last, L - (nblocks[s] - 1) * bs:] = nan
            self.pool.v_cache[last, L - (nblocks[s] - 1) * bs:] = nan
        padded = self.pool.raw[:, :self.pool.per_block].view(self.pool.num_blocks, 2, bs, Hkv, Dh + 5)
        padded[..., Dh:] = nan
        self.raw_before = self.pool.raw.clone()
        T = sum(q_lens)
        self.qkv = torch.randn(T, (Hq + 2 * Hkv) * Dh, generator=g).mul(1.5).to(act_dtype)  # (T, (Hq+2Hkv)*Dh)
        self.q = self.qkv[:, :Hq * Dh].view(T, Hq, Dh)  # a column slice, as after the qkv projection
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
        self.cu_q = cu(q_lens)
        self.out = torch.full((T, Hq, Dh), 99.0, dtype=act_dtype)

    def run(self, sliding_window=None, k_scale=0.7, v_scale=1.3, **over):
        args = dict(q=self.q, k_cache=self.pool.k_cache, v_cache=self.pool.v_cache, block_tables=self.block_tables,
                    seq_lens=self.seq_lens, cu_seqlens_q=self.cu_q, scale=self.Dh ** -0.5, k_scale=k_scale,
                    v_scale=v_scale, sliding_window=sliding_window, out=self.out)
        args.update(over)
        return attention.paged_attention(**args)

    def ref(self, sliding_window=None, k_scale=0.7, v_scale=1.3):
        return paged_attention_ref(self.q, self.pool.k_cache, self.pool.v_cache, self.block_tables, self.seq_lens,
                                   self.cu_q, self.Dh ** -0.5, k_scale, v_scale, sliding_window)


def _assert_out_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "the kernel read a position it must not (NaN) or left rows unwritten"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert_within_ulps(out, ref, dtype, ulps=1, atol=1e-6, what="attention output")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rep", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("cache_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_paged_attention_matches_ref(act_dtype, cache_dtype, batch, rep, window):
    case = AttnCase(act_dtype, cache_dtype, rep, **(DECODE if batch == "decode" else MIXED), seed=rep)
    qkv_before = case.qkv.clone()
    assert case.run(window) is True
    _assert_out_close(case.out, case.ref(window), act_dtype)
    assert_bits_equal(case.pool.raw, case.raw_before, "KV pool (read only)")
    assert torch.equal(case.qkv, qkv_before)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 3.0)])
def test_paged_attention_scales_and_block_size(k_scale, v_scale):
    case = AttnCase(torch.bfloat16, torch.float16, 2, q_lens=(3, 1, 17), seq_lens=(40, 16, 17), bs=16, Dh=64,
                    seed=4)
    assert case.run(7, k_scale=k_scale, v_scale=v_scale) is True
    _assert_out_close(case.out, case.ref(7, k_scale=k_scale, v_scale=v_scale), torch.bfloat16)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("rep", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cache_dtype", DTYPES, ids=dtype_id)
def test_decode_scores_sixteen_keys_at_a_time(cache_dtype, head_dim, rep, window):
    """Decode over contexts of whole 16-key runs, runs plus a tail, and shorter, in vector head sizes
    (the keys are summed 16 at a time there), runs that span 8-token blocks."""
    case = AttnCase(torch.bfloat16, cache_dtype, rep, q_lens=(1, 1, 1, 1, 1), seq_lens=(16, 33, 70, 9, 128),
                    bs=8, Dh=head_dim, seed=21)
    assert case.run(window) is True
    _assert_out_close(case.out, case.ref(window), torch.bfloat16)


@pytest.mark.parametrize("window", [None, 37])
def test_paged_attention_long_contexts_reuse_buffers(window):
    """Work items of very different sizes in a row (a long prefill, long and short decodes, a short
    prefill) on one thread: per-thread buffers grown for one item must serve the next."""
    case = AttnCase(torch.bfloat16, torch.bfloat16, 3, q_lens=(20, 1, 3, 1, 1, 40), seq_lens=(20, 150, 60, 3, 200, 41),
                    bs=16, Dh=32, seed=12)
    assert case.run(window) is True
    _assert_out_close(case.out, case.ref(window), torch.bfloat16)


def test_paged_attention_window_larger_than_context():
    case = AttnCase(torch.float32, torch.float32, 3, **MIXED, seed=5)
    assert case.run(1000) is True
    full = case.ref(None)
    _assert_out_close(case.out, full, torch.float32)
    assert case.run(1) is True  # each query sees only itself: the output is its own value vector
    _assert_out_close(case.out, case.ref(1), torch.float32)


def test_paged_attention_two_threads_match_one():
    case = AttnCase(torch.bfloat16, torch.bfloat16, 3, **MIXED, seed=6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert case.run(5)
        out2 = case.out.clone()
        torch.set_num_threads(1)
        assert case.run(5)
    finally:
        torch.set_num_threads(threads)
    assert_bits_equal(case.out, out2, "output")


# ----------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------


def _kv_write_inputs(act_dtype, cache_dtype, T=11, Hkv=2, Dh=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(cache_dtype, Hkv=Hkv, Dh=Dh, seed=seed + 1)
    qkv = torch.randn(T, (3 * Hkv + 2 * Hkv) * Dh, generator=g).mul(3).to(act_dtype)  # (T, (Hq+2Hkv)*Dh), Hq=3Hkv
    q_end = 3 * Hkv * Dh
    k = qkv[:, q_end:q_end + Hkv * Dh].view(T, Hkv, Dh)  # column slices, as after the qkv projection
    v = qkv[:, q_end + Hkv * Dh:].view(T, Hkv, Dh)
    slots = torch.randperm(pool.num_blocks * pool.bs, generator=g)[:T].to(torch.int64)  # distinct, scattered
    return pool, k, v, slots


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.7, 1.3)])
@pytest.mark.parametrize("cache_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("act_dtype", DTYPES, ids=dtype_id)
def test_kv_write_matches_ref(act_dtype, cache_dtype, k_scale, v_scale):
    pool, k, v, slots = _kv_write_inputs(act_dtype, cache_dtype, seed=3)
    expected = pool.raw.clone()
    ek, ev = pool.views(expected)
    write_kv_cache(k, v, ek, ev, slots, k_scale, v_scale)
    assert attention.kv_write(k, v, pool.k_cache, pool.v_cache, slots, k_scale, v_scale) is True
    assert_bits_equal(pool.raw, expected, "KV pool")  # the written slots, and nothing else


def test_kv_write_then_attention_equals_ref():
    """Write a prefill chunk with the kernel, then attend over it: as the reference pair."""
    act, cache = torch.bfloat16, torch.float16
    case = AttnCase(act, cache, 3, q_lens=(6, 1), seq_lens=(6, 9), seed=7)
    g = torch.Generator().manual_seed(8)
    k = torch.randn(7, 2, case.Dh, generator=g).to(act)  # the 7 new tokens' K, V
    v = torch.randn(7, 2, case.Dh, generator=g).to(act)
    bs = case.pool.bs
    pos = [(0, p) for p in range(6)] + [(1, 8)]
    slots = torch.tensor([int(case.block_tables[s, p // bs]) * bs + p % bs for s, p in pos])
    expected = case.pool.raw.clone()
    ek, ev = case.pool.views(expected)
    write_kv_cache(k, v, ek, ev, slots, 0.5, 2.0)
    assert attention.kv_write(k, v, case.pool.k_cache, case.pool.v_cache, slots, 0.5, 2.0)
    assert_bits_equal(case.pool.raw, expected, "KV pool")
    assert case.run(None, k_scale=0.5, v_scale=2.0)
    _assert_out_close(case.out, case.ref(None, k_scale=0.5, v_scale=2.0), act)


# ----------------------------------------------------------------------------------------------
# declined calls
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches_are_declined(fp8):
    pool, k, v, slots = _kv_write_inputs(torch.bfloat16, torch.float32, seed=9)
    k_cache = torch.zeros(pool.num_blocks, pool.bs, pool.Hkv, pool.Dh, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    assert attention.kv_write(k, v, k_cache, v_cache, slots, 1.0, 1.0) is False
    assert not k_cache.view(torch.uint8).any() and not v_cache.view(torch.uint8).any()
    T = 2
    q = torch.randn(T, 2 * pool.Hkv, pool.Dh, dtype=torch.bfloat16)
    out = torch.full_like(q, 5.0)
    ok = attention.paged_attention(q, k_cache, v_cache, torch.tensor([[1], [2]]), torch.tensor([1, 1]),
                                   cu([1, 1]), 0.2, 1.0, 1.0, None, out)
    assert ok is False
    assert (out == 5.0).all()


@pytest.mark.parametrize("change", [
    "v_other_strides", "slots_int32", "slots_short", "k_heads_strided", "k_int", "cache_float64", "v_dtype"])
def test_kv_write_declines_uncovered_calls(change):
    pool, k, v, slots = _kv_write_inputs(torch.float32, torch.float32, seed=10)
    k_cache, v_cache = pool.k_cache, pool.v_cache
    if change == "v_other_strides":
        v_cache = torch.zeros(pool.num_blocks, pool.bs, pool.Hkv, pool.Dh)  # contiguous: strides differ from K's
        assert v_cache.stride() != k_cache.stride()
    elif change == "slots_int32":
        slots = slots.int()
    elif change == "slots_short":
        slots = slots[:-1]
    elif change == "k_heads_strided":  # heads not adjacent: no (T, Hkv*Dh) row view
        k = torch.randn(k.shape[0], pool.Hkv, pool.Dh + 2)[..., :pool.Dh]
    elif change == "k_int":
        k, v = k.int(), v.int()
    elif change == "cache_float64":
        k_cache = torch.zeros(pool.num_blocks, pool.bs, pool.Hkv, pool.Dh, dtype=torch.float64)
        v_cache = torch.zeros_like(k_cache)
    elif change == "v_dtype":
        v = v.bfloat16()
    before = pool.raw.clone()
    assert attention.kv_write(k, v, k_cache, v_cache, slots, 1.0, 1.0) is False
    assert_bits_equal(pool.raw, before, "KV pool")
    if change in ("cache_float64", "v_other_strides"):
        assert not v_cache.any()


@pytest.mark.parametrize("change", [
    "out_noncontig", "out_dtype", "tables_int32", "seq_lens_int32", "cu_int32", "heads_not_divisible",
    "q_float64", "head_dim"])
def test_paged_attention_declines_uncovered_calls(change):
    case = AttnCase(torch.float32, torch.float32, 3, **MIXED, seed=11)
    over = {}
    if change == "out_noncontig":
        over["out"] = torch.zeros(case.q.shape[0], case.Dh, case.Hq).transpose(1, 2)
    elif change == "out_dtype":
        over["out"] = torch.zeros(case.q.shape, dtype=torch.bfloat16)
    elif change == "tables_int32":
        over["block_tables"] = case.block_tables.int()
    elif change == "seq_lens_int32":
        over["seq_lens"] = case.seq_lens.int()
    elif change == "cu_int32":
        over["cu_seqlens_q"] = case.cu_q.int()
    elif change == "heads_not_divisible":
        over["q"] = case.q[:, :5]
        over["out"] = torch.zeros(case.q.shape[0], 5, case.Dh)
    elif change == "q_float64":
        over["q"] = case.q.double()
        over["out"] = torch.zeros(case.q.shape, dtype=torch.float64)
    elif change == "head_dim":
        over["q"] = case.q[..., :-1].contiguous()
        over["out"] = torch.zeros(*case.q.shape[:2], case.Dh - 1)
    out = over.get("out", case.out)
    out_before = out.clone()
    assert case.run(**over) is False
    assert torch.equal(out.nan_to_num(), out_before.nan_to_num())
    assert (case.out == 99.0).all()
    assert_bits_equal(case.pool.raw, case.raw_before, "KV pool")
