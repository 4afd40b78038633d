"""Linear attention with per-head decay: chunked varlen scan and single-token update vs the
token-by-token references; output and final state, varlen packing, lengths not multiples of the
chunk, initial states, chunked prefill, prefill + decode, cache dtypes, strided state caches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.ops.linear_attention import (
    linear_attention_update,
    linear_attention_update_ref,
    linear_attention_varlen,
    linear_attention_varlen_ref,
)

STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)  # (S+1,)


def _decay(H):
    """MiniMax-like rates: a geometric series over heads, one head almost without decay."""
    rate = 0.5 ** (torch.arange(H, dtype=torch.float32) + 1)  # (H,)
    rate[-1] = 1e-5
    return rate


def _tokens(T, H, Dk, Dv, dtype=torch.float32):
    # MiniMax feeds silu(...) activations; keep magnitudes moderate
    q = (torch.randn(T, H, Dk) * 0.5).to(dtype)  # (T, H, Dk)
    k = (torch.randn(T, H, Dk) * 0.5).to(dtype)  # (T, H, Dk)
    v = torch.randn(T, H, Dv).to(dtype)  # (T, H, Dv)
    return q, k, v


def _assert_close_rel(a, b, rtol):
    """Max abs error relative to the reference's scale (fp32 chunked vs sequential sums)."""
    scale = b.abs().max().clamp(min=1.0)
    err = (a - b).abs().max()
    assert err <= rtol * scale, f"max err {err.item():.3g} > {rtol:g} * {scale.item():.3g}"


@pytest.mark.parametrize("lens", [[1, 7, 33, 70], [16, 32], [1], [70]])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_init", [False, True])
def test_varlen_matches_ref(lens, chunk_size, with_init):
    torch.manual_seed(0)
    H, Dk, Dv, S = 4, 8, 6, len(lens)
    q, k, v = _tokens(sum(lens), H, Dk, Dv)
    init = torch.randn(S, H, Dk, Dv) if with_init else None
    args = (q, k, v, _decay(H), _cu(lens), init)
    out, fin = linear_attention_varlen(*args, chunk_size=chunk_size)
    out_ref, fin_ref = linear_attention_varlen_ref(*args, chunk_size=chunk_size)
    assert out.shape == (sum(lens), H, Dv) and out.dtype == torch.float32
    assert fin.shape == (S, H, Dk, Dv) and fin.dtype == torch.float32
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_varlen_low_precision_inputs(x_dtype):
    """bf16/fp16 q, k, v (a bf16 model): math still float32, outputs float32, equal to the ref."""
    torch.manual_seed(1)
    H, Dk, Dv, lens = 2, 8, 8, [5, 40, 17]
    q, k, v = _tokens(sum(lens), H, Dk, Dv, x_dtype)
    init = torch.randn(len(lens), H, Dk, Dv).to(x_dtype)
    out, fin = linear_attention_varlen(q, k, v, _decay(H), _cu(lens), init, chunk_size=16)
    out_ref, fin_ref = linear_attention_varlen_ref(q, k, v, _decay(H), _cu(lens), init)
    assert out.dtype == torch.float32 and fin.dtype == torch.float32
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


def test_ref_matches_quadratic_form():
    """The recurrence equals the explicit form o_i = sum_{j<=i} exp(-s (i-j)) (q_i . k_j) v_j."""
    torch.manual_seed(2)
    H, D, L = 3, 4, 11
    q, k, v = _tokens(L, H, D, D)
    rate = _decay(H)
    out_ref, fin_ref = linear_attention_varlen_ref(q, k, v, rate, _cu([L]), None)
    i = torch.arange(L)
    gap = (i[:, None] - i[None, :]).float()  # (L, L)
    mask = torch.where(gap >= 0, torch.exp(-rate[:, None, None] * gap), 0.0)  # (H, L, L)
    scores = torch.einsum("ihk,jhk->hij", q, k) * mask  # (H, L, L)
    expected = torch.einsum("hij,jhv->ihv", scores, v)  # (L, H, D)
    torch.testing.assert_close(out_ref, expected, rtol=1e-5, atol=1e-5)
    state = torch.einsum("hj,jhk,jhv->hkv", torch.exp(-rate[:, None] * (L - 1 - i).float()), k, v)
    torch.testing.assert_close(fin_ref[0], state, rtol=1e-5, atol=1e-5)


def test_packed_equals_per_sequence():
    torch.manual_seed(3)
    H, Dk, Dv, lens = 4, 8, 8, [1, 7, 33, 70]
    q, k, v = _tokens(sum(lens), H, Dk, Dv)
    init = torch.randn(len(lens), H, Dk, Dv)
    cu = _cu(lens)
    out, fin = linear_attention_varlen(q, k, v, _decay(H), cu, init, chunk_size=16)
    for s, L in enumerate(lens):
        a, e = int(cu[s]), int(cu[s + 1])
        out_s, fin_s = linear_attention_varlen(q[a:e], k[a:e], v[a:e], _decay(H), _cu([L]),
                                               init[s:s + 1], chunk_size=16)
        torch.testing.assert_close(out[a:e], out_s, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fin[s:s + 1], fin_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64, 128])
def test_chunk_size_invariance(chunk_size):
    torch.manual_seed(4)
    H, Dk, Dv, lens = 2, 4, 4, [1, 7, 33, 70]
    q, k, v = _tokens(sum(lens), H, Dk, Dv)
    init = torch.randn(len(lens), H, Dk, Dv)
    base = linear_attention_varlen(q, k, v, _decay(H), _cu(lens), init, chunk_size=16)
    other = linear_attention_varlen(q, k, v, _decay(H), _cu(lens), init, chunk_size=chunk_size)
    _assert_close_rel(other[0], base[0], 1e-5)
    _assert_close_rel(other[1], base[1], 1e-5)


def test_chunked_prefill_equals_single_prefill():
    """Two prefill calls passing final states as initial states == one call."""
    torch.manual_seed(5)
    H, Dk, Dv = 4, 8, 8
    first, second = [7, 33, 1], [20, 5, 40]
    full = [a + b for a, b in zip(first, second)]
    q, k, v = _tokens(sum(full), H, Dk, Dv)
    cu = _cu(full)
    out_full, fin_full = linear_attention_varlen(q, k, v, _decay(H), cu, None, chunk_size=16)
    p1 = torch.cat([torch.arange(int(cu[s]), int(cu[s]) + first[s]) for s in range(3)])
    p2 = torch.cat([torch.arange(int(cu[s]) + first[s], int(cu[s + 1])) for s in range(3)])
    _, fin1 = linear_attention_varlen(q[p1], k[p1], v[p1], _decay(H), _cu(first), None, chunk_size=16)
    out2, fin2 = linear_attention_varlen(q[p2], k[p2], v[p2], _decay(H), _cu(second), fin1, chunk_size=16)
    _assert_close_rel(out2, out_full[p2], 1e-5)
    _assert_close_rel(fin2, fin_full, 1e-5)


def test_stable_with_strong_decay_and_long_sequence():
    """Large rates (exp(-s * chunk) underflows) over long sequences: finite and equal to the ref."""
    torch.manual_seed(6)
    H, D, lens = 3, 4, [300, 45]
    rate = torch.tensor([20.0, 0.9, 0.0])  # (H,): forgets within a step, fast, never
    q, k, v = _tokens(sum(lens), H, D, D)
    init = torch.randn(len(lens), H, D, D) * 100
    out, fin = linear_attention_varlen(q, k, v, rate, _cu(lens), init, chunk_size=256)
    out_ref, fin_ref = linear_attention_varlen_ref(q, k, v, rate, _cu(lens), init)
    assert torch.isfinite(out).all() and torch.isfinite(fin).all()
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_update_matches_ref_on_strided_cache(state_dtype, strided_caches, tol):
    torch.manual_seed(7)
    num_slots, H, Dk, Dv, B = 5, 4, 8, 6, 3
    caches = strided_caches((num_slots, H, Dk, Dv), state_dtype, n_views=2)
    cache, cache_ref = caches.random_state()
    q, k, v = _tokens(B, H, Dk, Dv)
    idx = torch.tensor([3, 0, 4])

    out = linear_attention_update(cache, q, k, v, _decay(H), idx)
    out_ref = linear_attention_update_ref(cache_ref, q, k, v, _decay(H), idx)

    assert out.shape == (B, H, Dv) and out.dtype == torch.float32
    _assert_close_rel(out, out_ref, 1e-5)
    caches.assert_updated_like(cache_ref, idx, tol(state_dtype))


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_prefill_then_decode_equals_full_scan(state_dtype, prefill_then_decode):
    torch.manual_seed(8)
    H, Dk, Dv = 4, 8, 8
    q, k, v = _tokens(prefill_then_decode.num_tokens, H, Dk, Dv)
    rate = _decay(H)

    def scan(t, cu):
        return linear_attention_varlen(q[t], k[t], v[t], rate, cu, None, chunk_size=16)

    def update(cache, t, slots):
        return linear_attention_update(cache, q[t], k[t], v[t], rate, slots)

    prefill_then_decode(scan, update, (H, Dk, Dv), state_dtype)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    H=st.integers(1, 3),
    Dk=st.integers(1, 5),
    Dv=st.integers(1, 5),
    chunk_size=st.sampled_from([4, 16, 32]),
    with_init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_varlen_matches_ref_random(lens, H, Dk, Dv, chunk_size, with_init, seed):
    torch.manual_seed(seed)
    q, k, v = _tokens(sum(lens), H, Dk, Dv)
    rate = torch.rand(H) * 2  # (H,)
    init = torch.randn(len(lens), H, Dk, Dv) if with_init else None
    args = (q, k, v, rate, _cu(lens), init)
    out, fin = linear_attention_varlen(*args, chunk_size=chunk_size)
    out_ref, fin_ref = linear_attention_varlen_ref(*args, chunk_size=chunk_size)
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)
