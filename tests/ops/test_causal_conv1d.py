"""causal_conv1d: fast paths vs references, HF/nn.Conv1d convention, varlen packing,
prefill + decode consistency, strided caches of every state dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.ops.causal_conv1d import (
    causal_conv1d_update,
    causal_conv1d_update_ref,
    causal_conv1d_varlen,
    causal_conv1d_varlen_ref,
)

STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cu(lens):
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)  # (S+1,)


def _inputs(lens, D, K, x_dtype=torch.float32, with_init=True, with_bias=True):
    T, S = sum(lens), len(lens)
    x = torch.randn(T, D).to(x_dtype)  # (T, D)
    w = torch.randn(D, K) * 0.5  # (D, K)
    b = torch.randn(D) if with_bias else None  # (D,)
    init = torch.randn(S, D, K - 1) if with_init else None  # (S, D, K-1)
    return x, w, b, _cu(lens), init


@pytest.mark.parametrize("lens", [[1], [1, 7, 33, 70], [5, 2, 3], [16, 16]])
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_varlen_matches_ref(lens, K, with_init, activation):
    torch.manual_seed(0)
    x, w, b, cu, init = _inputs(lens, 12, K, with_init=with_init)
    y, fin = causal_conv1d_varlen(x, w, b, cu, init, activation)
    y_ref, fin_ref = causal_conv1d_varlen_ref(x, w, b, cu, init, activation)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert fin.shape == (len(lens), 12, K - 1) and fin.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, fin_ref, rtol=0, atol=0)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_varlen_low_precision_input(x_dtype, tol):
    torch.manual_seed(1)
    x, w, b, cu, init = _inputs([3, 9, 20], 8, 4, x_dtype=x_dtype)
    y, fin = causal_conv1d_varlen(x, w, b, cu, init.to(x_dtype), "silu")
    y_ref, fin_ref = causal_conv1d_varlen_ref(x, w, b, cu, init.to(x_dtype), "silu")
    assert y.dtype == x_dtype and fin.dtype == torch.float32
    rtol, atol = tol(x_dtype)
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(fin, fin_ref, rtol=0, atol=0)


def test_ref_matches_nn_conv1d_convention():
    """No initial state: y equals Conv1d(groups=D, padding=K-1) truncated, as HF Mamba2 does."""
    torch.manual_seed(2)
    D, K, L = 6, 4, 11
    x, w, b, cu, _ = _inputs([L], D, K, with_init=False)
    y_ref, fin_ref = causal_conv1d_varlen_ref(x, w, b, cu, None, None)
    conv = F.conv1d(x.T[None], w[:, None, :], b, padding=K - 1, groups=D)[0, :, :L].T  # (L, D)
    torch.testing.assert_close(y_ref, conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin_ref[0], x[-(K - 1):].T)


def test_initial_state_equals_prepended_tokens():
    """An initial state behaves exactly like K-1 earlier tokens of the same sequence."""
    torch.manual_seed(3)
    D, K = 5, 4
    x, w, b, _, _ = _inputs([K - 1 + 9], D, K, with_init=False)
    y_full, fin_full = causal_conv1d_varlen(x, w, b, _cu([K - 1 + 9]), None, "silu")
    init = x[: K - 1].T[None].contiguous()  # (1, D, K-1)
    y_tail, fin_tail = causal_conv1d_varlen(x[K - 1:], w, b, _cu([9]), init, "silu")
    torch.testing.assert_close(y_tail, y_full[K - 1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fin_tail, fin_full)


def test_packed_equals_per_sequence():
    torch.manual_seed(4)
    lens = [1, 7, 33, 70]
    x, w, b, cu, init = _inputs(lens, 10, 4)
    y, fin = causal_conv1d_varlen(x, w, b, cu, init, "silu")
    for s, L in enumerate(lens):
        a, e = int(cu[s]), int(cu[s + 1])
        y_s, fin_s = causal_conv1d_varlen(x[a:e], w, b, _cu([L]), init[s:s + 1], "silu")
        torch.testing.assert_close(y[a:e], y_s, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fin[s:s + 1], fin_s)


def test_short_sequence_keeps_part_of_initial_state():
    """Sequence shorter than K-1: the final state still contains initial-state columns."""
    torch.manual_seed(5)
    x, w, b, cu, init = _inputs([1, 2], 4, 4)
    _, fin = causal_conv1d_varlen(x, w, b, cu, init, None)
    torch.testing.assert_close(fin[0], torch.cat([init[0, :, 1:], x[0:1].T], dim=1))
    torch.testing.assert_close(fin[1], torch.cat([init[1, :, 2:], x[1:3].T], dim=1))


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_update_matches_ref_on_strided_cache(state_dtype, activation, strided_caches):
    torch.manual_seed(6)
    num_slots, D, K, B = 6, 8, 4, 3
    caches = strided_caches((num_slots, D, K - 1), state_dtype, n_views=2)
    cache, cache_ref = caches.random_state()
    x = torch.randn(B, D)  # (B, D)
    w, b = torch.randn(D, K), torch.randn(D)
    idx = torch.tensor([4, 0, 2])  # (B,)

    y = causal_conv1d_update(x, cache, w, b, idx, activation)
    y_ref = causal_conv1d_update_ref(x, cache_ref, w, b, idx, activation)

    assert y.dtype == x.dtype and y.shape == (B, D)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    fresh = caches.assert_updated_like(cache_ref, idx)  # exactly equal: tol (0, 0)
    # the window shifted by one and the new token was stored, cast to the cache dtype
    assert torch.equal(fresh[idx, :, -1], x.to(state_dtype))


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_prefill_then_decode_equals_full_prefill(state_dtype, tol):
    """varlen prefill of the first tokens + update per token == varlen over all tokens."""
    torch.manual_seed(7)
    D, K = 8, 4
    prompt, extra = [1, 7, 5], [4, 3, 6]
    S = len(prompt)
    full = [p + e for p, e in zip(prompt, extra)]
    x_full, w, b, cu_full, init = _inputs(full, D, K)
    init = init.to(state_dtype)
    y_full, fin_full = causal_conv1d_varlen(x_full, w, b, cu_full, init, "silu")

    slots = torch.tensor([3, 0, 5])  # (S,)
    cache = torch.zeros(7, D, K - 1, dtype=state_dtype)  # (num_slots, D, K-1)
    seqs = [x_full[int(cu_full[s]):int(cu_full[s + 1])] for s in range(S)]
    x_pre = torch.cat([seqs[s][:prompt[s]] for s in range(S)])
    y_pre, fin_pre = causal_conv1d_varlen(x_pre, w, b, _cu(prompt), init, "silu")
    cache[slots] = fin_pre.to(state_dtype)
    ys = [[y_pre[int(_cu(prompt)[s]):int(_cu(prompt)[s + 1])]] for s in range(S)]
    for step in range(max(extra)):
        live = [s for s in range(S) if step < extra[s]]
        x_step = torch.stack([seqs[s][prompt[s] + step] for s in live])  # (B, D)
        y_step = causal_conv1d_update(x_step, cache, w, b, slots[live], "silu")
        for i, s in enumerate(live):
            ys[s].append(y_step[i:i + 1])
    y_cat = torch.cat([torch.cat(parts) for parts in ys])

    rtol, atol = tol(state_dtype)
    torch.testing.assert_close(y_cat, y_full, rtol=rtol, atol=atol)
    torch.testing.assert_close(cache[slots].float(), fin_full, rtol=rtol, atol=atol)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    D=st.integers(1, 6),
    K=st.integers(1, 5),
    with_init=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_varlen_matches_ref_random(lens, D, K, with_init, with_bias, seed):
    torch.manual_seed(seed)
    x, w, b, cu, init = _inputs(lens, D, K, with_init=with_init, with_bias=with_bias)
    y, fin = causal_conv1d_varlen(x, w, b, cu, init, "silu")
    y_ref, fin_ref = causal_conv1d_varlen_ref(x, w, b, cu, init, "silu")
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, fin_ref, rtol=0, atol=0)
