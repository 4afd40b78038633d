"""Paged KV cache write + paged attention: the reference vs SDPA on a contiguous layout, the
fast path vs the reference (prefill, mixed, decode, GQA, sliding window, every KV dtype),
fp8 quantization, strided caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.ops.paged_attention import paged_attention, paged_attention_ref, write_kv_cache

KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
# tolerance of attention over K/V stored in that dtype vs. the float32 K/V (quantization error)
KV_QUANT_ATOL = {
    torch.float32: 1e-5,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
    torch.float8_e4m3fn: 0.15,
    torch.float8_e5m2: 0.3,
}


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)  # (S+1,)


class PagedBatch:
    """Random contexts for S sequences written into a paged cache with shuffled block tables."""

    def __init__(self, seq_lens, q_lens, Hq, Hkv, Dh, block_size, kv_dtype,
                 k_scale=1.0, v_scale=1.0, cache_views=None, q_dtype=torch.float32):
        S = len(seq_lens)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)  # (S,)
        self.cu_q = _cu(q_lens)  # (S+1,)
        self.k = [torch.randn(L, Hkv, Dh) for L in seq_lens]  # per seq (L, Hkv, Dh) float32
        self.v = [torch.randn(L, Hkv, Dh) for L in seq_lens]
        self.q = torch.randn(sum(q_lens), Hq, Dh).to(q_dtype)  # (T, Hq, Dh)
        n_blocks = [-(-L // block_size) for L in seq_lens]
        max_blocks = max(n_blocks) + 1
        num_blocks = sum(n_blocks) + 3
        if cache_views is None:
            shape = (num_blocks, block_size, Hkv, Dh)
            cache_views = (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
        self.k_cache, self.v_cache = cache_views
        perm = torch.randperm(num_blocks)  # scattered physical blocks
        self.block_tables = torch.zeros(S, max_blocks, dtype=torch.int64)  # unused entries: 0
        used = 0
        for s, L in enumerate(seq_lens):
            self.block_tables[s, :n_blocks[s]] = perm[used:used + n_blocks[s]]
            used += n_blocks[s]
            pos = torch.arange(L)
            slots = self.block_tables[s, pos // block_size] * block_size + pos % block_size
            write_kv_cache(self.k[s], self.v[s], self.k_cache, self.v_cache, slots,
                           k_scale, v_scale)
        self.k_scale, self.v_scale = k_scale, v_scale

    def args(self, scale, window=None):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.cu_q,
                scale, self.k_scale, self.v_scale, window)


def _sdpa_per_sequence(batch, scale, window, k_list=None, v_list=None):
    """Dense SDPA over contiguous float32 K/V, one sequence at a time (mask from positions)."""
    k_list = batch.k if k_list is None else k_list
    v_list = batch.v if v_list is None else v_list
    outs = []
    for s in range(len(k_list)):
        L = k_list[s].shape[0]
        q = batch.q[int(batch.cu_q[s]):int(batch.cu_q[s + 1])].float()  # (n, Hq, Dh)
        n = q.shape[0]
        qpos = torch.arange(L - n, L)[:, None]  # (n, 1)
        kpos = torch.arange(L)[None, :]  # (1, L)
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k_list[s].transpose(0, 1), v_list[s].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True)  # (Hq, n, Dh)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)  # (T, Hq, Dh)


# ----------------------------------------------------------------------------------------------
# write_kv_cache
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_cache_strided_views(kv_dtype, strided_caches):
    """K and V blocks interleaved in one byte buffer; writes land in place and nowhere else."""
    torch.manual_seed(0)
    num_blocks, bs, Hkv, Dh, T = 5, 4, 2, 8, 7
    caches = strided_caches((num_blocks, bs, Hkv, Dh), kv_dtype, n_views=2)
    k_cache, v_cache = caches.views
    assert not k_cache.is_contiguous()
    k, v = torch.randn(T, Hkv, Dh), torch.randn(T, Hkv, Dh)
    slots = torch.randperm(num_blocks * bs)[:T]  # (T,)
    write_kv_cache(k, v, k_cache, v_cache, slots, 0.5, 2.0)
    kf, vf = caches.fresh_view(0), caches.fresh_view(1)
    blk, off = slots // bs, slots % bs
    assert torch.equal(kf[blk, off].float(), (k / 0.5).to(kv_dtype).float())
    assert torch.equal(vf[blk, off].float(), (v / 2.0).to(kv_dtype).float())
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots] = True
    unwritten = (~written).nonzero().squeeze(1)
    before = strided_caches((num_blocks, bs, Hkv, Dh), kv_dtype, n_views=2).views[0]
    assert torch.equal(kf.view(torch.uint8).reshape(num_blocks * bs, -1)[unwritten],
                       before.view(torch.uint8).reshape(num_blocks * bs, -1)[unwritten])
    assert caches.foreign_bytes_intact()


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_cache_fp8_saturates(kv_dtype):
    fmax = torch.finfo(kv_dtype).max
    k = torch.tensor([[[1e9, -1e9, 3.0, fmax * 2]]])  # (1, 1, 4)
    k_cache = torch.zeros(2, 2, 1, 4, dtype=kv_dtype)
    v_cache = torch.zeros(2, 2, 1, 4, dtype=kv_dtype)
    write_kv_cache(k, k, k_cache, v_cache, torch.tensor([3]), 1.0, 1.0)
    stored = k_cache[1, 1, 0].float()
    assert torch.isfinite(stored).all()
    assert stored.tolist() == [fmax, -fmax, 3.0, fmax]


# ----------------------------------------------------------------------------------------------
# the reference itself
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 1), (6, 2)])
def test_ref_matches_sdpa(window, Hq, Hkv):
    torch.manual_seed(1)
    batch = PagedBatch([9, 23, 4], [9, 6, 1], Hq, Hkv, 8, 4, torch.float32)
    scale = 8 ** -0.5
    out = paged_attention_ref(*batch.args(scale, window))
    torch.testing.assert_close(out, _sdpa_per_sequence(batch, scale, window),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_cache_close_to_float32_attention(kv_dtype):
    """Attention over the dequantized cache approximates float32 attention (scales != 1)."""
    torch.manual_seed(2)
    batch = PagedBatch([17, 5], [17, 2], 4, 2, 16, 8, kv_dtype, k_scale=0.25, v_scale=0.5)
    scale = 16 ** -0.5
    out = paged_attention(*batch.args(scale))
    torch.testing.assert_close(out, _sdpa_per_sequence(batch, scale, None),
                               rtol=0, atol=KV_QUANT_ATOL[kv_dtype])


# ----------------------------------------------------------------------------------------------
# fast path vs reference
# ----------------------------------------------------------------------------------------------

CASES = {
    "prefill": ([1, 7, 33, 20], [1, 7, 33, 20]),
    "mixed": ([10, 7, 45, 3], [1, 7, 20, 2]),
    "decode": ([10, 1, 45, 16], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 6])
def test_fast_matches_ref(case, kv_dtype, Hq, Hkv, window):
    torch.manual_seed(3)
    seq_lens, q_lens = CASES[case]
    batch = PagedBatch(seq_lens, q_lens, Hq, Hkv, 8, 4, kv_dtype, k_scale=0.5, v_scale=1.5)
    out = paged_attention(*batch.args(0.3, window))
    ref = paged_attention_ref(*batch.args(0.3, window))
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # same cache: fp32 math only


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_queries(case):
    torch.manual_seed(4)
    seq_lens, q_lens = CASES[case]
    batch = PagedBatch(seq_lens, q_lens, 4, 2, 8, 4, torch.bfloat16, q_dtype=torch.bfloat16)
    out = paged_attention(*batch.args(0.35))
    ref = paged_attention_ref(*batch.args(0.35))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_on_strided_caches(case, strided_caches):
    torch.manual_seed(5)
    seq_lens, q_lens = CASES[case]
    n_blocks = sum(-(-L // 4) for L in seq_lens) + 3
    caches = strided_caches((n_blocks, 4, 2, 8), torch.bfloat16, n_views=2)
    batch = PagedBatch(seq_lens, q_lens, 4, 2, 8, 4, torch.bfloat16, cache_views=caches.views)
    out = paged_attention(*batch.args(0.35, 5))
    torch.testing.assert_close(out, paged_attention_ref(*batch.args(0.35, 5)),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _sdpa_per_sequence(batch, 0.35, 5), rtol=0, atol=3e-2)
    assert caches.foreign_bytes_intact()


def test_unused_block_table_entries_are_ignored():
    torch.manual_seed(6)
    batch = PagedBatch([10, 3, 29], [2, 3, 1], 4, 2, 8, 4, torch.float32)
    out = paged_attention(*batch.args(0.3))
    num_blocks = batch.k_cache.shape[0]
    for s, L in enumerate([10, 3, 29]):
        used = -(-L // 4)
        batch.block_tables[s, used:] = torch.randint(0, num_blocks, (batch.block_tables.shape[1]
                                                                     - used,))
    assert torch.equal(paged_attention(*batch.args(0.3)), out)


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=4),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_fast_matches_ref_random(seqs, heads, block_size, window, seed):
    torch.manual_seed(seed)
    seq_lens = [max(a, b) for a, b in seqs]
    q_lens = [min(a, b) for a, b in seqs]
    batch = PagedBatch(seq_lens, q_lens, heads[0], heads[1], 4, block_size, torch.float32)
    out = paged_attention(*batch.args(0.5, window))
    torch.testing.assert_close(out, paged_attention_ref(*batch.args(0.5, window)),
                               rtol=1e-5, atol=1e-5)
