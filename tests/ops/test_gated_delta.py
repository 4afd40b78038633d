"""Gated delta rule: chunked varlen scan and single-token update vs the token-by-token references;
HF's conventions (head repetition, l2 norm, scale, state layout), varlen packing, chunk-size
invariance, chunked prefill, prefill + decode, cache dtypes, strided state caches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.ops.gated_delta import (
    gated_delta_rule_update,
    gated_delta_rule_update_ref,
    gated_delta_rule_varlen,
    gated_delta_rule_varlen_ref,
)

STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)  # (S+1,)


def _tokens(T, Hk, Hv, Dk, Dv, strong_decay=False):
    q = torch.randn(T, Hk, Dk)  # (T, Hk, Dk)
    k = torch.randn(T, Hk, Dk)  # (T, Hk, Dk)
    v = torch.randn(T, Hv, Dv)  # (T, Hv, Dv)
    a = torch.randn(T, Hv)
    A = torch.empty(Hv).uniform_(0.01, 16.0 if strong_decay else 2.0)  # (Hv,) as exp(A_log)
    g = -A * torch.nn.functional.softplus(a + 1.0)  # (T, Hv) log decay <= 0
    beta = torch.rand(T, Hv)  # (T, Hv) in (0, 1)
    return q, k, v, g, beta


def _assert_close_rel(a, b, rtol):
    """Max abs error relative to the reference's scale (fp32 chunked vs sequential sums)."""
    scale = b.abs().max().clamp(min=1.0)
    err = (a - b).abs().max()
    assert err <= rtol * scale, f"max err {err.item():.3g} > {rtol:g} * {scale.item():.3g}"


@pytest.mark.parametrize("lens", [[1, 7, 33, 70], [16, 32], [1], [70]])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("with_init", [False, True])
def test_scan_matches_ref(lens, Hk, Hv, with_init):
    torch.manual_seed(0)
    Dk, Dv, S = 8, 4, len(lens)
    q, k, v, g, beta = _tokens(sum(lens), Hk, Hv, Dk, Dv)
    init = torch.randn(S, Hv, Dk, Dv) if with_init else None
    args = (q, k, v, g, beta, _cu(lens), init)
    out, fin = gated_delta_rule_varlen(*args, use_qk_l2norm=True, chunk_size=16)
    out_ref, fin_ref = gated_delta_rule_varlen_ref(*args, use_qk_l2norm=True, chunk_size=16)
    assert out.shape == v.shape and out.dtype == torch.float32
    assert fin.shape == (S, Hv, Dk, Dv) and fin.dtype == torch.float32
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_scan_options_match_ref(use_qk_l2norm, scale):
    torch.manual_seed(1)
    Hk, Hv, Dk, Dv, lens = 2, 4, 6, 5, [5, 19]
    q, k, v, g, beta = _tokens(sum(lens), Hk, Hv, Dk, Dv)
    if not use_qk_l2norm:  # keep the un-normalized delta rule contractive: |k| small
        k = k * 0.2
    init = torch.randn(len(lens), Hv, Dk, Dv)
    args = (q, k, v, g, beta, _cu(lens), init)
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=8)
    out, fin = gated_delta_rule_varlen(*args, **kw)
    out_ref, fin_ref = gated_delta_rule_varlen_ref(*args, **kw)
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


def test_matches_transformers_reference():
    """Same conventions as HF's torch_chunk/recurrent_gated_delta_rule: value head h reads key
    head h // (Hv // Hk), q/k l2-normalized in float32, q scaled by Dk ** -0.5, state (Hv, Dk, Dv)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    torch.manual_seed(2)
    Hk, Hv, Dk, Dv, L = 2, 4, 8, 6, 37
    q, k, v, g, beta = _tokens(L, Hk, Hv, Dk, Dv)
    init = torch.randn(1, Hv, Dk, Dv)
    out, fin = gated_delta_rule_varlen(q, k, v, g, beta, _cu([L]), init, use_qk_l2norm=True, chunk_size=16)
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        out_hf, fin_hf = fn(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=init,
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        _assert_close_rel(out, out_hf[0], 1e-5)
        _assert_close_rel(fin, fin_hf, 1e-5)


def test_packed_equals_per_sequence():
    torch.manual_seed(3)
    Hk, Hv, Dk, Dv, lens = 2, 4, 8, 4, [1, 7, 33, 70]
    q, k, v, g, beta = _tokens(sum(lens), Hk, Hv, Dk, Dv)
    init = torch.randn(len(lens), Hv, Dk, Dv)
    cu = _cu(lens)
    out, fin = gated_delta_rule_varlen(q, k, v, g, beta, cu, init, use_qk_l2norm=True, chunk_size=16)
    for s, L in enumerate(lens):
        a, e = int(cu[s]), int(cu[s + 1])
        out_s, fin_s = gated_delta_rule_varlen(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], _cu([L]),
                                               init[s:s + 1], use_qk_l2norm=True, chunk_size=16)
        torch.testing.assert_close(out[a:e], out_s, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fin[s:s + 1], fin_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64, 128])
def test_chunk_size_invariance(chunk_size):
    torch.manual_seed(4)
    Hk, Hv, Dk, Dv, lens = 1, 2, 8, 4, [1, 7, 33, 70]
    q, k, v, g, beta = _tokens(sum(lens), Hk, Hv, Dk, Dv)
    init = torch.randn(len(lens), Hv, Dk, Dv)
    args = (q, k, v, g, beta, _cu(lens), init)
    base = gated_delta_rule_varlen(*args, use_qk_l2norm=True, chunk_size=16)
    other = gated_delta_rule_varlen(*args, use_qk_l2norm=True, chunk_size=chunk_size)
    _assert_close_rel(other[0], base[0], 1e-5)
    _assert_close_rel(other[1], base[1], 1e-5)


def test_chunked_prefill_equals_single_prefill():
    """Two prefill calls passing final states as initial states == one call."""
    torch.manual_seed(5)
    Hk, Hv, Dk, Dv = 2, 4, 8, 4
    first, second = [7, 33, 1], [20, 5, 40]
    full = [a + b for a, b in zip(first, second)]
    q, k, v, g, beta = _tokens(sum(full), Hk, Hv, Dk, Dv)
    cu = _cu(full)
    kw = dict(use_qk_l2norm=True, chunk_size=16)
    out_full, fin_full = gated_delta_rule_varlen(q, k, v, g, beta, cu, None, **kw)
    p1 = torch.cat([torch.arange(int(cu[s]), int(cu[s]) + first[s]) for s in range(3)])
    p2 = torch.cat([torch.arange(int(cu[s]) + first[s], int(cu[s + 1])) for s in range(3)])
    _, fin1 = gated_delta_rule_varlen(q[p1], k[p1], v[p1], g[p1], beta[p1], _cu(first), None, **kw)
    out2, fin2 = gated_delta_rule_varlen(q[p2], k[p2], v[p2], g[p2], beta[p2], _cu(second), fin1, **kw)
    _assert_close_rel(out2, out_full[p2], 1e-5)
    _assert_close_rel(fin2, fin_full, 1e-5)


def test_stable_with_strong_decay_and_long_sequence():
    """Strong decay (the state forgets within a step) over long sequences: finite, matches ref."""
    torch.manual_seed(6)
    Hk, Hv, Dk, Dv, lens = 1, 2, 4, 3, [300, 45]
    q, k, v, g, beta = _tokens(sum(lens), Hk, Hv, Dk, Dv, strong_decay=True)
    g[:, 0] = -80.0  # exp(g) underflows in float32 on head 0
    init = torch.randn(len(lens), Hv, Dk, Dv) * 100
    args = (q, k, v, g, beta, _cu(lens), init)
    out, fin = gated_delta_rule_varlen(*args, use_qk_l2norm=True, chunk_size=64)
    out_ref, fin_ref = gated_delta_rule_varlen_ref(*args, use_qk_l2norm=True, chunk_size=64)
    assert torch.isfinite(out).all() and torch.isfinite(fin).all()
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)


def test_low_precision_inputs():
    """bf16 activations are upcast: output equals the float32 run on the same (rounded) values."""
    torch.manual_seed(7)
    Hk, Hv, Dk, Dv, lens = 2, 4, 8, 4, [9, 20]
    ins = [t.to(torch.bfloat16) for t in _tokens(sum(lens), Hk, Hv, Dk, Dv)]
    out, fin = gated_delta_rule_varlen(*ins, _cu(lens), None, use_qk_l2norm=True, chunk_size=8)
    out32, fin32 = gated_delta_rule_varlen(*[t.float() for t in ins], _cu(lens), None, use_qk_l2norm=True,
                                           chunk_size=8)
    assert out.dtype == torch.float32 and fin.dtype == torch.float32
    torch.testing.assert_close(out, out32)
    torch.testing.assert_close(fin, fin32)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
def test_update_matches_ref_on_strided_cache(state_dtype, Hk, Hv, strided_caches, tol):
    torch.manual_seed(8)
    num_slots, Dk, Dv, B = 5, 8, 4, 3
    caches = strided_caches((num_slots, Hv, Dk, Dv), state_dtype, n_views=2)
    cache, cache_ref = caches.random_state()
    q, k, v, g, beta = _tokens(B, Hk, Hv, Dk, Dv)
    idx = torch.tensor([3, 0, 4])

    out = gated_delta_rule_update(cache, q, k, v, g, beta, idx, use_qk_l2norm=True)
    out_ref = gated_delta_rule_update_ref(cache_ref, q, k, v, g, beta, idx, use_qk_l2norm=True)

    assert out.shape == (B, Hv, Dv) and out.dtype == torch.float32
    _assert_close_rel(out, out_ref, 1e-5)
    caches.assert_updated_like(cache_ref, idx, tol(state_dtype))


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_prefill_then_decode_equals_full_scan(state_dtype, prefill_then_decode):
    torch.manual_seed(9)
    Hk, Hv, Dk, Dv = 2, 4, 8, 4
    q, k, v, g, beta = _tokens(prefill_then_decode.num_tokens, Hk, Hv, Dk, Dv)

    def scan(t, cu):
        return gated_delta_rule_varlen(q[t], k[t], v[t], g[t], beta[t], cu, None, chunk_size=16, use_qk_l2norm=True)

    def update(cache, t, slots):
        return gated_delta_rule_update(cache, q[t], k[t], v[t], g[t], beta[t], slots, use_qk_l2norm=True)

    prefill_then_decode(scan, update, (Hv, Dk, Dv), state_dtype)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    Hk_R=st.sampled_from([(1, 1), (1, 3), (2, 2)]),
    Dk=st.integers(1, 6),
    Dv=st.integers(1, 4),
    chunk_size=st.sampled_from([4, 16, 32]),
    with_init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scan_matches_ref_random(lens, Hk_R, Dk, Dv, chunk_size, with_init, seed):
    torch.manual_seed(seed)
    Hk, R = Hk_R
    Hv = Hk * R
    q, k, v, g, beta = _tokens(sum(lens), Hk, Hv, Dk, Dv)
    init = torch.randn(len(lens), Hv, Dk, Dv) if with_init else None
    args = (q, k, v, g, beta, _cu(lens), init)
    out, fin = gated_delta_rule_varlen(*args, use_qk_l2norm=True, chunk_size=chunk_size)
    out_ref, fin_ref = gated_delta_rule_varlen_ref(*args, use_qk_l2norm=True, chunk_size=chunk_size)
    _assert_close_rel(out, out_ref, 1e-5)
    _assert_close_rel(fin, fin_ref, 1e-5)
