"""Mamba1 selective scan: blocked varlen scan and single-token update vs the token-by-token
references; HF's recurrence, varlen packing, block boundaries, chunked prefill, prefill + decode,
strided state caches of every dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.ops.selective_scan import (
    selective_scan_varlen,
    selective_scan_varlen_ref,
    selective_state_update,
    selective_state_update_ref,
)

STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)  # (S+1,)


def _params(Dm, N, with_D=True, with_bias=True):
    A = -torch.arange(1, N + 1, dtype=torch.float32).repeat(Dm, 1) * torch.rand(Dm, 1).add(0.5)  # (D, N)
    D = torch.randn(Dm) if with_D else None  # (D,)
    dt_bias = torch.randn(Dm) * 0.5 - 1.0 if with_bias else None  # (D,)
    return A, D, dt_bias


def _tokens(T, Dm, N, with_z=True):
    x = torch.randn(T, Dm)  # (T, D)
    dt = torch.randn(T, Dm)  # (T, D) raw (before bias / softplus)
    B = torch.randn(T, N)  # (T, N)
    C = torch.randn(T, N)  # (T, N)
    z = torch.randn(T, Dm) if with_z else None  # (T, D)
    return x, dt, B, C, z


def _assert_close_rel(a, b, rtol):
    """Max abs error relative to the reference's scale (blocked vs sequential float32 sums)."""
    scale = b.abs().max().clamp(min=1.0)
    err = (a - b).abs().max()
    assert err <= rtol * scale, f"max err {err.item():.3g} > {rtol:g} * {scale.item():.3g}"


def _hf_style_scan(x, dt, A, B, C, D, z, dt_bias):
    """HF MambaMixer's sequential CPU scan, one sequence (x, dt, z: (D, L); B, C: (N, L))."""
    dt = F.softplus(dt + dt_bias[:, None])  # (D, L)
    dA = torch.exp(A[:, None, :] * dt[:, :, None])  # (D, L, N)
    dBu = dt[:, :, None] * B.T[None] * x[:, :, None]  # (D, L, N)
    h = torch.zeros(x.shape[0], A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        h = dA[:, t] * h + dBu[:, t]
        ys.append(h @ C[:, t])
    y = torch.stack(ys, dim=-1) + x * D[:, None]  # (D, L)
    return y * F.silu(z), h


def test_ref_matches_hf_recurrence():
    torch.manual_seed(10)
    Dm, N, L = 6, 4, 13
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(L, Dm, N)
    y_hf, h_hf = _hf_style_scan(x.T, dt.T, A, B.T, C.T, D, z.T, dt_bias)
    y, fin = selective_scan_varlen_ref(x, dt, A, B, C, D, z, dt_bias, True, _cu([L]), None)
    torch.testing.assert_close(y, y_hf.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin[0], h_hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[1, 7, 33, 70], [16, 25], [1], [70], [2, 1, 3]])
@pytest.mark.parametrize("with_init", [False, True])
def test_scan_matches_ref(lens, with_init):
    torch.manual_seed(0)
    Dm, N, S = 6, 5, len(lens)
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(sum(lens), Dm, N)
    init = torch.randn(S, Dm, N) if with_init else None
    args = (x, dt, A, B, C, D, z, dt_bias, True, _cu(lens), init)
    y, fin = selective_scan_varlen(*args)
    y_ref, fin_ref = selective_scan_varlen_ref(*args)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert fin.shape == (S, Dm, N) and fin.dtype == torch.float32
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("with_z", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dt_softplus", [False, True])
def test_scan_options_match_ref(with_D, with_z, with_bias, dt_softplus):
    torch.manual_seed(1)
    Dm, N, lens = 4, 3, [5, 19]
    A, D, dt_bias = _params(Dm, N, with_D, with_bias)
    x, dt, B, C, z = _tokens(sum(lens), Dm, N, with_z)
    if not dt_softplus:
        dt = dt.abs() * 0.3  # a raw dt must be >= 0 to be a valid step
        dt_bias = None if dt_bias is None else dt_bias.abs() * 0.1
    init = torch.randn(len(lens), Dm, N)
    args = (x, dt, A, B, C, D, z, dt_bias, dt_softplus, _cu(lens), init)
    y, fin = selective_scan_varlen(*args)
    y_ref, fin_ref = selective_scan_varlen_ref(*args)
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


def test_low_precision_inputs():
    """bf16 activations are read as float32; the result is float32 and matches the reference."""
    torch.manual_seed(8)
    Dm, N, lens = 4, 3, [9, 30]
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = (t.bfloat16() for t in _tokens(sum(lens), Dm, N))
    init = torch.randn(len(lens), Dm, N).bfloat16()
    args = (x, dt, A, B, C, D, z, dt_bias, True, _cu(lens), init)
    y, fin = selective_scan_varlen(*args)
    y_ref, fin_ref = selective_scan_varlen_ref(*args)
    assert y.dtype == torch.float32 and fin.dtype == torch.float32
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


def test_packed_equals_per_sequence():
    torch.manual_seed(2)
    Dm, N, lens = 5, 4, [1, 7, 33, 70]
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(sum(lens), Dm, N)
    init = torch.randn(len(lens), Dm, N)
    cu = _cu(lens)
    y, fin = selective_scan_varlen(x, dt, A, B, C, D, z, dt_bias, True, cu, init)
    for s, L in enumerate(lens):
        a, e = int(cu[s]), int(cu[s + 1])
        y_s, fin_s = selective_scan_varlen(x[a:e], dt[a:e], A, B[a:e], C[a:e], D, z[a:e], dt_bias, True,
                                           _cu([L]), init[s:s + 1])
        torch.testing.assert_close(y[a:e], y_s, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fin[s:s + 1], fin_s, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_single_prefill():
    """Two scans passing final states as initial states == one scan."""
    torch.manual_seed(4)
    Dm, N = 4, 3
    first, second = [7, 33, 1], [20, 5, 40]
    full = [a + b for a, b in zip(first, second)]
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(sum(full), Dm, N)
    cu = _cu(full)
    y_full, fin_full = selective_scan_varlen(x, dt, A, B, C, D, z, dt_bias, True, cu, None)
    p1 = torch.cat([torch.arange(int(cu[s]), int(cu[s]) + first[s]) for s in range(3)])
    p2 = torch.cat([torch.arange(int(cu[s]) + first[s], int(cu[s + 1])) for s in range(3)])
    _, fin1 = selective_scan_varlen(x[p1], dt[p1], A, B[p1], C[p1], D, z[p1], dt_bias, True, _cu(first), None)
    y2, fin2 = selective_scan_varlen(x[p2], dt[p2], A, B[p2], C[p2], D, z[p2], dt_bias, True, _cu(second), fin1)
    _assert_close_rel(y2, y_full[p2], 1e-5)
    _assert_close_rel(fin2, fin_full, 1e-5)


def test_stable_with_strong_decay_and_long_sequence():
    """Large |dt*A| (a channel forgets within a step) over 500 tokens: no inf/NaN, matches ref."""
    torch.manual_seed(5)
    Dm, N, lens = 3, 4, [500, 45]
    A = torch.tensor([[-60.0, -30.0, -1.0, -0.01]]).repeat(Dm, 1)  # (D, N)
    x, dt, B, C, z = _tokens(sum(lens), Dm, N)
    dt = dt.abs() * 5  # (T, D) large steps
    init = torch.randn(len(lens), Dm, N) * 100
    args = (x, dt, A, B, C, None, z, None, True, _cu(lens), init)
    y, fin = selective_scan_varlen(*args)
    y_ref, fin_ref = selective_scan_varlen_ref(*args)
    assert torch.isfinite(y).all() and torch.isfinite(fin).all()
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("with_z", [False, True])
def test_update_matches_ref_on_strided_cache(state_dtype, with_z, strided_caches, tol):
    torch.manual_seed(6)
    num_slots, Dm, N, Bsz = 5, 6, 4, 3
    caches = strided_caches((num_slots, Dm, N), state_dtype, n_views=2)
    cache, cache_ref = caches.random_state()
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(Bsz, Dm, N, with_z)
    idx = torch.tensor([3, 0, 4])

    y = selective_state_update(cache, x, dt, A, B, C, D, z, dt_bias, True, idx)
    y_ref = selective_state_update_ref(cache_ref, x, dt, A, B, C, D, z, dt_bias, True, idx)

    assert y.shape == (Bsz, Dm) and y.dtype == torch.float32
    _assert_close_rel(y, y_ref, 1e-5)
    caches.assert_updated_like(cache_ref, idx, tol(state_dtype))


def test_update_equals_one_token_scan():
    """One update step == a one-token scan from the same initial state."""
    torch.manual_seed(9)
    Dm, N, Bsz = 6, 4, 3
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(Bsz, Dm, N)
    init = torch.randn(Bsz, Dm, N)
    cache = init.clone()
    y = selective_state_update(cache, x, dt, A, B, C, D, z, dt_bias, True, torch.arange(Bsz))
    y_scan, fin = selective_scan_varlen(x, dt, A, B, C, D, z, dt_bias, True, _cu([1] * Bsz), init)
    _assert_close_rel(y, y_scan, 1e-6)
    _assert_close_rel(cache, fin, 1e-6)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_prefill_then_decode_equals_full_scan(state_dtype, prefill_then_decode):
    torch.manual_seed(7)
    Dm, N = 6, 4
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(prefill_then_decode.num_tokens, Dm, N)

    def scan(t, cu):
        return selective_scan_varlen(x[t], dt[t], A, B[t], C[t], D, z[t], dt_bias, True, cu, None)

    def update(cache, t, slots):
        return selective_state_update(cache, x[t], dt[t], A, B[t], C[t], D, z[t], dt_bias, True, slots)

    prefill_then_decode(scan, update, (Dm, N), state_dtype)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    Dm=st.integers(1, 5),
    N=st.integers(1, 4),
    with_init=st.booleans(),
    with_z=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scan_matches_ref_random(lens, Dm, N, with_init, with_z, seed):
    torch.manual_seed(seed)
    A, D, dt_bias = _params(Dm, N)
    x, dt, B, C, z = _tokens(sum(lens), Dm, N, with_z)
    init = torch.randn(len(lens), Dm, N) if with_init else None
    args = (x, dt, A, B, C, D, z, dt_bias, True, _cu(lens), init)
    y, fin = selective_scan_varlen(*args)
    y_ref, fin_ref = selective_scan_varlen_ref(*args)
    _assert_close_rel(y, y_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)
