"""Kimi delta attention ops: the chunked varlen scan and the decode step against the token-by-token references,
HF's torch fallbacks (``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``), stepping, cache dtypes."""

from __future__ import annotations

import pytest
import torch

from hybridserve.ops.kda import kda_update, kda_update_ref, kda_varlen, kda_varlen_ref


def _kda_inputs(lens: list[int], H: int = 3, D: int = 8, seed: int = 0):
    """Packed q, k, v (T, H, D), log decay g (T, H, D) <= 0, beta (T, H), cu_seqlens, initial states (S, H, D, D)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    decay = -torch.rand(T, H, D, generator=g) * 2.0  # strong and weak per-channel decays
    beta = torch.rand(T, H, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    init = torch.randn(len(lens), H, D, D, generator=g) * 0.3
    return q, k, v, decay, beta, cu, init


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_kda_chunked_scan_is_the_token_recurrence(chunk_size):
    """Lengths below, at and past the chunk, with initial states: outputs and final states equal the token loop."""
    q, k, v, g, beta, cu, init = _kda_inputs([1, 4, 9, 37])
    ref_out, ref_state = kda_varlen_ref(q, k, v, g, beta, cu, init, use_qk_l2norm=True)
    out, state = kda_varlen(q, k, v, g, beta, cu, init, use_qk_l2norm=True, chunk_size=chunk_size)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_kda_ops_match_hf_chunked_and_recurrent_fallbacks():
    """HF's torch ``chunk_kimi_delta_attention`` (prefill) and ``recurrent_kimi_delta_attention`` (decode) on one
    sequence: our scan gives their outputs and final state, and our decode step continues from it as theirs does."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    q, k, v, g, beta, cu, init = _kda_inputs([70], H=2, D=16, seed=3)
    hf_out, hf_state = chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], initial_state=init,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = kda_varlen(q, k, v, g, beta, cu, init, use_qk_l2norm=True)
    torch.testing.assert_close(out, hf_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, hf_state, atol=1e-5, rtol=1e-5)
    q1, k1, v1, g1, b1, _, _ = _kda_inputs([1], H=2, D=16, seed=4)
    hf_step, hf_next = recurrent_kimi_delta_attention(q1[None], k1[None], v1[None], g1[None], b1[None],
                                                      initial_state=hf_state, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    states = state.clone()
    step = kda_update(states, q1, k1, v1, g1, b1, torch.tensor([0]), use_qk_l2norm=True)
    torch.testing.assert_close(step, hf_step[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, hf_next, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kda_decode_step_is_the_reference_and_the_scan(state_dtype):
    """Vectorized decode on scattered slots equals the per-sequence reference, in the cache dtype; stepping token by
    token from a zero state ends where the chunked scan of the same tokens does."""
    q, k, v, g, beta, _, init = _kda_inputs([1, 1, 1], seed=5)
    slots = torch.tensor([4, 0, 2])
    pool = torch.zeros(5, 3, 8, 8, dtype=state_dtype)
    pool[slots] = init.to(state_dtype)
    pool_ref = pool.clone()
    out = kda_update(pool, q, k, v, g, beta, slots, use_qk_l2norm=True)
    out_ref = kda_update_ref(pool_ref, q, k, v, g, beta, slots, use_qk_l2norm=True)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    assert pool.dtype == state_dtype and torch.equal(pool, pool_ref)
    q, k, v, g, beta, cu, _ = _kda_inputs([23], seed=6)
    _, scanned = kda_varlen(q, k, v, g, beta, cu, None, use_qk_l2norm=True)
    stepped = torch.zeros(1, 3, 8, 8)
    for t in range(23):
        kda_update(stepped, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], torch.tensor([0]),
                   use_qk_l2norm=True)
    torch.testing.assert_close(stepped, scanned, atol=1e-5, rtol=1e-5)
