"""Mamba2 SSD: chunked varlen scan and single-token update vs the token-by-token references;
varlen packing, chunk-size invariance, chunked prefill, prefill + decode, strided state caches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.ops.ssd import (
    mamba2_chunk_scan_varlen,
    mamba2_chunk_scan_varlen_ref,
    mamba2_state_update,
    mamba2_state_update_ref,
)

NO_LIMIT = (0.0, math.inf)
STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)  # (S+1,)


def _params(H, G, with_D=True, with_bias=True):
    A = -torch.exp(torch.rand(H) * 2 - 1)  # (H,) negative, as -exp(A_log)
    D = torch.randn(H) if with_D else None  # (H,)
    dt_bias = torch.randn(H) * 0.5 - 1.0 if with_bias else None  # (H,)
    return A, D, dt_bias


def _tokens(T, H, P, G, N):
    x = torch.randn(T, H, P)  # (T, H, P)
    dt = torch.randn(T, H)  # (T, H), raw (before bias / softplus)
    B = torch.randn(T, G, N)  # (T, G, N)
    C = torch.randn(T, G, N)  # (T, G, N)
    return x, dt, B, C


def _assert_close_rel(a, b, rtol):
    """Max abs error relative to the reference's scale (fp32 chunked vs sequential sums)."""
    scale = b.abs().max().clamp(min=1.0)
    err = (a - b).abs().max()
    assert err <= rtol * scale, f"max err {err.item():.3g} > {rtol:g} * {scale.item():.3g}"


@pytest.mark.parametrize("lens", [[1, 7, 33, 70], [16, 32], [1], [70]])
@pytest.mark.parametrize("H,G", [(4, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("with_init", [False, True])
def test_scan_matches_ref(lens, H, G, with_init):
    torch.manual_seed(0)
    P, N, S = 3, 5, len(lens)
    A, D, dt_bias = _params(H, G)
    x, dt, B, C = _tokens(sum(lens), H, P, G, N)
    init = torch.randn(S, H, P, N) if with_init else None
    args = (x, dt, A, B, C, 16, D, dt_bias, True, NO_LIMIT, _cu(lens), init)
    y, fin = mamba2_chunk_scan_varlen(*args)
    y_ref, fin_ref = mamba2_chunk_scan_varlen_ref(*args)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert fin.shape == (S, H, P, N) and fin.dtype == torch.float32
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dt_softplus", [False, True])
@pytest.mark.parametrize("dt_limit", [NO_LIMIT, (0.01, 0.5)])
def test_scan_options_match_ref(with_D, with_bias, dt_softplus, dt_limit):
    torch.manual_seed(1)
    H, G, P, N, lens = 4, 2, 2, 4, [5, 19]
    A, D, dt_bias = _params(H, G, with_D, with_bias)
    x, dt, B, C = _tokens(sum(lens), H, P, G, N)
    if not dt_softplus:
        dt = dt.abs() * 0.3  # a raw dt must be >= 0 to be a valid step
        dt_bias = None if dt_bias is None else dt_bias.abs() * 0.1
    init = torch.randn(len(lens), H, P, N)
    args = (x, dt, A, B, C, 8, D, dt_bias, dt_softplus, dt_limit, _cu(lens), init)
    y, fin = mamba2_chunk_scan_varlen(*args)
    y_ref, fin_ref = mamba2_chunk_scan_varlen_ref(*args)
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


def test_packed_equals_per_sequence():
    torch.manual_seed(2)
    H, G, P, N, lens = 4, 2, 3, 4, [1, 7, 33, 70]
    A, D, dt_bias = _params(H, G)
    x, dt, B, C = _tokens(sum(lens), H, P, G, N)
    init = torch.randn(len(lens), H, P, N)
    cu = _cu(lens)
    y, fin = mamba2_chunk_scan_varlen(x, dt, A, B, C, 16, D, dt_bias, True, NO_LIMIT, cu, init)
    for s, L in enumerate(lens):
        a, e = int(cu[s]), int(cu[s + 1])
        y_s, fin_s = mamba2_chunk_scan_varlen(
            x[a:e], dt[a:e], A, B[a:e], C[a:e], 16, D, dt_bias, True, NO_LIMIT, _cu([L]),
            init[s:s + 1])
        torch.testing.assert_close(y[a:e], y_s, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fin[s:s + 1], fin_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64, 128])
def test_chunk_size_invariance(chunk_size):
    torch.manual_seed(3)
    H, G, P, N, lens = 2, 1, 2, 3, [1, 7, 33, 70]
    A, D, dt_bias = _params(H, G)
    x, dt, B, C = _tokens(sum(lens), H, P, G, N)
    init = torch.randn(len(lens), H, P, N)
    base = mamba2_chunk_scan_varlen(x, dt, A, B, C, 16, D, dt_bias, True, NO_LIMIT, _cu(lens), init)
    other = mamba2_chunk_scan_varlen(
        x, dt, A, B, C, chunk_size, D, dt_bias, True, NO_LIMIT, _cu(lens), init)
    _assert_close_rel(other[0], base[0], 1e-5)
    _assert_close_rel(other[1], base[1], 1e-5)


def test_chunked_prefill_equals_single_prefill():
    """Two prefill calls passing final states as initial states == one call."""
    torch.manual_seed(4)
    H, G, P, N = 4, 2, 3, 4
    first, second = [7, 33, 1], [20, 5, 40]
    full = [a + b for a, b in zip(first, second)]
    A, D, dt_bias = _params(H, G)
    x, dt, B, C = _tokens(sum(full), H, P, G, N)
    cu = _cu(full)
    y_full, fin_full = mamba2_chunk_scan_varlen(x, dt, A, B, C, 16, D, dt_bias, True, NO_LIMIT, cu,
                                                None)
    parts1 = torch.cat([torch.arange(int(cu[s]), int(cu[s]) + first[s]) for s in range(3)])
    parts2 = torch.cat([torch.arange(int(cu[s]) + first[s], int(cu[s + 1])) for s in range(3)])
    _, fin1 = mamba2_chunk_scan_varlen(x[parts1], dt[parts1], A, B[parts1], C[parts1], 16, D,
                                       dt_bias, True, NO_LIMIT, _cu(first), None)
    y2, fin2 = mamba2_chunk_scan_varlen(x[parts2], dt[parts2], A, B[parts2], C[parts2], 16, D,
                                        dt_bias, True, NO_LIMIT, _cu(second), fin1)
    _assert_close_rel(y2, y_full[parts2], 1e-5)
    _assert_close_rel(fin2, fin_full, 1e-5)


def test_stable_with_strong_decay_and_long_sequence():
    """Large |dt*A| (state forgets within a step) over a long sequence: no inf/NaN, matches ref."""
    torch.manual_seed(5)
    H, G, P, N, lens = 2, 1, 2, 3, [300, 45]
    A = torch.tensor([-60.0, -0.01])  # (H,)
    x, dt, B, C = _tokens(sum(lens), H, P, G, N)
    dt = dt.abs() * 5  # (T, H) large steps
    init = torch.randn(len(lens), H, P, N) * 100
    args = (x, dt, A, B, C, 64, None, None, True, NO_LIMIT, _cu(lens), init)
    y, fin = mamba2_chunk_scan_varlen(*args)
    y_ref, fin_ref = mamba2_chunk_scan_varlen_ref(*args)
    assert torch.isfinite(y).all() and torch.isfinite(fin).all()
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("G", [1, 2, 4])
def test_update_matches_ref_on_strided_cache(state_dtype, G, strided_caches, tol):
    torch.manual_seed(6)
    num_slots, H, P, N, Bsz = 5, 4, 3, 4, 3
    caches = strided_caches((num_slots, H, P, N), state_dtype, n_views=2)
    cache, cache_ref = caches.random_state()
    A, D, dt_bias = _params(H, G)
    x, dt, B, C = _tokens(Bsz, H, P, G, N)
    idx = torch.tensor([3, 0, 4])

    y = mamba2_state_update(cache, x, dt, A, B, C, D, dt_bias, True, NO_LIMIT, idx)
    y_ref = mamba2_state_update_ref(cache_ref, x, dt, A, B, C, D, dt_bias, True, NO_LIMIT, idx)

    assert y.shape == (Bsz, H, P) and y.dtype == torch.float32
    _assert_close_rel(y, y_ref, 1e-5)
    caches.assert_updated_like(cache_ref, idx, tol(state_dtype))


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_prefill_then_decode_equals_full_scan(state_dtype, prefill_then_decode):
    torch.manual_seed(7)
    H, G, P, N = 4, 2, 3, 4
    A, D, dt_bias = _params(H, G)
    x, dt, B, C = _tokens(prefill_then_decode.num_tokens, H, P, G, N)

    def scan(t, cu):
        return mamba2_chunk_scan_varlen(x[t], dt[t], A, B[t], C[t], 16, D, dt_bias, True, NO_LIMIT, cu, None)

    def update(cache, t, slots):
        return mamba2_state_update(cache, x[t], dt[t], A, B[t], C[t], D, dt_bias, True, NO_LIMIT, slots)

    prefill_then_decode(scan, update, (H, P, N), state_dtype)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    G_R=st.sampled_from([(1, 1), (1, 3), (2, 2)]),
    P=st.integers(1, 3),
    N=st.integers(1, 4),
    chunk_size=st.sampled_from([4, 16, 32]),
    with_init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scan_matches_ref_random(lens, G_R, P, N, chunk_size, with_init, seed):
    torch.manual_seed(seed)
    G, R = G_R
    H = G * R
    A, D, dt_bias = _params(H, G)
    x, dt, B, C = _tokens(sum(lens), H, P, G, N)
    init = torch.randn(len(lens), H, P, N) if with_init else None
    args = (x, dt, A, B, C, chunk_size, D, dt_bias, True, NO_LIMIT, _cu(lens), init)
    y, fin = mamba2_chunk_scan_varlen(*args)
    y_ref, fin_ref = mamba2_chunk_scan_varlen_ref(*args)
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)
