"""Kimi delta attention (KDA): the gated delta rule with a per-channel decay, chunked varlen scan and
single-token state update.

Per sequence and head, with a state S of shape (Dk, Dv) (HF's layout, (H, Dk, Dv) per sequence) and a
log decay g_t of shape (Dk,) -- one per key channel, where Gated DeltaNet has one scalar per head:

    q_t, k_t <- l2norm(q_t), l2norm(k_t)     (when use_qk_l2norm); q_t <- q_t * scale
    S   <- diag(exp(g_t)) S                   g_t <= 0, each row of S decays on its own
    u_t  = beta_t * (v_t - S^T k_t)           (Dv,) the delta-rule correction
    S   <- S + k_t u_t^T
    o_t  = S^T q_t                            (Dv,)

Chunked form (per chunk of length l, G = within-chunk cumsum of g, (l, Dk); S0 the incoming state):
    U = (I + A)^-1 (beta*V - beta*(exp(G) o K) S0)  with A[i, j] = beta_i sum_d k_i,d k_j,d exp(G_i,d - G_j,d), j < i
    O = (exp(G) o Q) S0 + M U                       with M[i, j] = sum_d q_i,d k_j,d exp(G_i,d - G_j,d), j <= i
    S_end = diag(exp(G_l)) S0 + (exp(G_l - G) o K)^T U
The decay sits inside the channel sums, so A and M need the (l, l, Dk) tensor exp(G_i - G_j) (only
j <= i, all <= 1: no overflow); it is built one chunk at a time to bound memory.

Math is float32; outputs are float32; cache writes are cast to the cache's dtype.
"""

from __future__ import annotations

import torch

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.ops._varlen import chunk_grid, packed_positions, pad_to_chunks
from hybridserve.ops.gated_delta import (  # _prepare: one q/k head per value head here
    _prepare,
    delta_rule_update_loop,
    delta_rule_varlen_loop,
)


def kda_varlen_ref(q, k, v, g, beta, cu_seqlens, initial_states, *, scale=None, use_qk_l2norm=False,
                   chunk_size=16):
    """Reference: token-by-token recurrence (chunk_size is ignored).

    q, k: (T, H, Dk); v: (T, H, Dv); g: (T, H, Dk) log decay; beta: (T, H); cu_seqlens: (S+1,) int64;
    initial_states: (S, H, Dk, Dv) or None (zeros); scale: None means Dk ** -0.5.
    Returns out: (T, H, Dv) float32 and final_states: (S, H, Dk, Dv) float32.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    return delta_rule_varlen_loop(q, k, v, g, beta, cu_seqlens, initial_states)


def kda_varlen(q, k, v, g, beta, cu_seqlens, initial_states, *, scale=None, use_qk_l2norm=False, chunk_size=16):
    """Fast path: chunked form, vectorized over sequences padded to a multiple of the chunk length
    (padded steps have g = 0, beta = 0 and k = v = 0: they leave the state unchanged).

    Arguments and results: as :func:`kda_varlen_ref`.
    """
    T, H, Dv = v.shape
    Dk = k.shape[2]
    S = cu_seqlens.numel() - 1
    dev = v.device
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    _, lens, seq_id, pos = packed_positions(cu_seqlens, T, dev)  # pos: position within its sequence
    l, nc = chunk_grid(lens, chunk_size)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return pad_to_chunks(t, seq_id, pos, S, nc, l)

    qc, kc, vc, gc = pad(q), pad(k), pad(v), pad(g)  # (S, H, c, l, Dk|Dv)
    bc = pad(beta)  # (S, H, c, l)
    G = gc.cumsum(-2)  # (S, H, c, l, Dk) log decay from the chunk start through each position
    causal = torch.ones(l, l, dtype=torch.bool, device=dev).tril()  # [i, j]: j <= i
    strict = causal.tril(-1)
    eye = torch.eye(l, device=dev)

    state = (torch.zeros(S, H, Dk, Dv, dtype=torch.float32, device=dev) if initial_states is None
             else initial_states.float())  # (S, H, Dk, Dv)
    out = torch.empty(S, H, nc, l, Dv, dtype=torch.float32, device=dev)  # (S, H, c, l, Dv)
    for c in range(nc):
        Gc, qi, ki, vi, bi = G[:, :, c], qc[:, :, c], kc[:, :, c], vc[:, :, c], bc[:, :, c]
        diff = (Gc[..., :, None, :] - Gc[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
        decay = diff.exp()  # (S, H, l, l, Dk): exp(G_i - G_j) for j <= i, else 0
        kk = (ki[..., :, None, :] * ki[..., None, :, :] * decay).sum(-1)  # (S, H, l, l)
        system = (kk * bi[..., None]).masked_fill(~strict, 0.0) + eye  # I + A, unit lower triangular
        rhs = torch.cat([vi * bi[..., None], (ki * Gc.exp()) * bi[..., None]], dim=-1)  # (S, H, l, Dv + Dk)
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        U = sol[..., :Dv] - sol[..., Dv:] @ state  # (S, H, l, Dv)
        M = (qi[..., :, None, :] * ki[..., None, :, :] * decay).sum(-1)  # (S, H, l, l), 0 above the diagonal
        out[:, :, c] = (qi * Gc.exp()) @ state + M @ U
        k_dec = ki * (Gc[..., -1:, :] - Gc).exp()  # (S, H, l, Dk) writes the outgoing state
        state = state * Gc[..., -1, :].exp()[..., None] + k_dec.transpose(-1, -2) @ U
    out = out.reshape(S, H, nc * l, Dv).transpose(1, 2)  # (S, Lpad, H, Dv)
    return out[seq_id, pos], state.contiguous()


def kda_update_ref(states, q, k, v, g, beta, state_indices, *, scale=None, use_qk_l2norm=False):
    """Reference: per-sequence loop.

    states: (num_slots, H, Dk, Dv) cache (any strides), updated in place in its own dtype;
    q, k: (B, H, Dk); v: (B, H, Dv); g: (B, H, Dk); beta: (B, H); state_indices: (B,) int64.
    Returns out: (B, H, Dv) float32.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    return delta_rule_update_loop(states, q, k, v, g, beta, state_indices)


def kda_update(states, q, k, v, g, beta, state_indices, *, scale=None, use_qk_l2norm=False):
    """Fast path, vectorized over the batch (slots in state_indices must be distinct).

    Arguments and results: as :func:`kda_update_ref`.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    idx = state_indices.to(device=states.device, dtype=torch.long)  # (B,)
    state = read_slots(states, idx) * g.exp()[..., None]  # (B, H, Dk, Dv)
    u = beta[..., None] * (v - (state * k[..., None]).sum(2))  # (B, H, Dv)
    state = state + k[..., None] * u[:, :, None, :]
    out = (state * q[..., None]).sum(2)  # (B, H, Dv)
    write_slots(states, idx, state)  # in place into the cache
    return out
