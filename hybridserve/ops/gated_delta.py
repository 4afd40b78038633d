"""Gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next): chunked varlen scan and
single-token state update.

Per sequence and value head h, served by key head h // (Hv // Hk) (HF's ``repeat_interleave``),
with a state S of shape (Dk, Dv) -- the layout HF transformers uses, (Hv, Dk, Dv) per sequence:

    q_t, k_t <- l2norm(q_t), l2norm(k_t)     (when use_qk_l2norm); q_t <- q_t * scale
    S   <- exp(g_t) * S                       g_t <= 0 is a log decay
    u_t  = beta_t * (v_t - S^T k_t)           (Dv,) the delta-rule correction
    S   <- S + k_t u_t^T
    o_t  = S^T q_t                            (Dv,)

Chunked form (per chunk of length l, G = within-chunk cumsum of g, S0 the incoming state):
    U = (I + A)^-1 (beta*V - beta*exp(G)*K S0)   with A[i, j] = beta_i exp(G_i - G_j) k_i.k_j, j < i
    O = (exp(G)*Q) S0 + (QK^T o exp(G_i - G_j))_{j <= i} U
    S_end = exp(G_l) S0 + (exp(G_l - G) * K)^T U
The two triangular solves are done once for all chunks; only the state passes chunk to chunk.

Math is float32; outputs are float32; cache writes are cast to the cache's dtype.
"""

from __future__ import annotations

import torch

from hybridserve.cache.slots import read_slot, read_slots, write_slot, write_slots
from hybridserve.ops._varlen import chunk_grid, packed_positions, pad_to_chunks


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / HF convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Float32 inputs with q/k repeated to the value heads, normalized and q scaled.

    q, k: (N, Hk, Dk); v: (N, Hv, Dv); g, beta: (N, Hv) -> q, k (N, Hv, Dk), v, g, beta float32.
    """
    Hk, Dk = k.shape[1], k.shape[2]
    Hv = v.shape[1]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=1)  # (N, Hv, Dk)
        k = k.repeat_interleave(Hv // Hk, dim=1)
    q = q * (Dk ** -0.5 if scale is None else scale)
    return q, k, v.float(), g.float(), beta.float()


# ----------------------------------------------------------------------------------------------
# varlen chunked scan
# ----------------------------------------------------------------------------------------------


def gated_delta_rule_varlen_ref(q, k, v, g, beta, cu_seqlens, initial_states, *, scale=None,
                                use_qk_l2norm=False, chunk_size=64):
    """Reference: token-by-token recurrence (chunk_size is ignored).

    q, k: (T, Hk, Dk); v: (T, Hv, Dv); g, beta: (T, Hv); cu_seqlens: (S+1,) int64;
    initial_states: (S, Hv, Dk, Dv) or None (zeros); scale: None means Dk ** -0.5.
    Returns out: (T, Hv, Dv) float32 and final_states: (S, Hv, Dk, Dv) float32.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    return delta_rule_varlen_loop(q, k, v, g[..., None], beta, cu_seqlens, initial_states)


def delta_rule_varlen_loop(q, k, v, log_decay, beta, cu_seqlens, initial_states):
    """The delta rule token by token on prepared float32 inputs, the one reference recurrence of the gated
    delta net (``log_decay`` (T, H, 1): one decay per head) and of Kimi delta attention ((T, H, Dk): one per
    key channel). q, k: (T, H, Dk); v: (T, H, Dv); beta: (T, H); initial_states: (S, H, Dk, Dv) or None.
    Returns out: (T, H, Dv) and final_states: (S, H, Dk, Dv), float32.
    """
    T, H, Dv = v.shape
    Dk = k.shape[2]
    S = cu_seqlens.numel() - 1
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=v.device)  # (T, H, Dv)
    final = torch.empty(S, H, Dk, Dv, dtype=torch.float32, device=v.device)  # (S, H, Dk, Dv)
    for s in range(S):
        state = (torch.zeros(H, Dk, Dv, dtype=torch.float32, device=v.device) if initial_states is None
                 else initial_states[s].float())  # (H, Dk, Dv)
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            state = state * log_decay[t].exp()[:, :, None]
            kv_mem = (state * k[t][:, :, None]).sum(1)  # (H, Dv)
            u = beta[t][:, None] * (v[t] - kv_mem)  # (H, Dv)
            state = state + k[t][:, :, None] * u[:, None, :]
            out[t] = (state * q[t][:, :, None]).sum(1)
        final[s] = state
    return out, final


def gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, initial_states, *, scale=None,
                            use_qk_l2norm=False, chunk_size=64):
    """Fast path: chunked form, vectorized over sequences padded to a multiple of chunk_size
    (padded steps have g = 0 and beta = 0, k = v = 0: they leave the state unchanged).

    Arguments and results: as ``gated_delta_rule_varlen_ref``.
    """
    T, Hv, Dv = v.shape
    Dk = k.shape[2]
    S = cu_seqlens.numel() - 1
    dev = v.device
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    _, lens, seq_id, pos = packed_positions(cu_seqlens, T, dev)  # pos: position within its sequence
    l, nc = chunk_grid(lens, chunk_size)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return pad_to_chunks(t, seq_id, pos, S, nc, l)

    qc, kc, vc = pad(q), pad(k), pad(v)  # (S, H, c, l, Dk|Dv)
    gc, bc = pad(g), pad(beta)  # (S, H, c, l)
    G = gc.cumsum(-1)  # (S, H, c, l) log decay from the chunk start through each position

    causal = torch.ones(l, l, dtype=torch.bool, device=dev).tril()  # [i, j]: j <= i
    strict = causal.tril(-1)
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf"))  # (S, H, c, l, l)
    decay = diff.exp()  # exp(G_i - G_j) for j <= i, else 0

    kb = kc * bc[..., None]  # (S, H, c, l, Dk)
    system = ((kb @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)  # (S, H, c, l, l)
    system = system + torch.eye(l, device=dev)  # I + A (unit lower triangular)
    W = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    X = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    # W: (S, H, c, l, Dv), X: (S, H, c, l, Dk); per chunk U = W - X @ S0

    attn = (qc @ kc.transpose(-1, -2)) * decay  # (S, H, c, l, l) causal incl. the diagonal
    q_dec = qc * G.exp()[..., None]  # (S, H, c, l, Dk) reads the incoming state
    k_dec = kc * (G[..., -1:] - G).exp()[..., None]  # (S, H, c, l, Dk) writes the outgoing state
    chunk_decay = G[..., -1].exp()  # (S, H, c)

    if initial_states is None:
        state = torch.zeros(S, Hv, Dk, Dv, dtype=torch.float32, device=dev)  # (S, H, Dk, Dv)
    else:
        state = initial_states.float()
    out = torch.empty(S, Hv, nc, l, Dv, dtype=torch.float32, device=dev)  # (S, H, c, l, Dv)
    for c in range(nc):  # chunks, not tokens
        U = W[:, :, c] - X[:, :, c] @ state  # (S, H, l, Dv)
        out[:, :, c] = q_dec[:, :, c] @ state + attn[:, :, c] @ U
        state = state * chunk_decay[:, :, c, None, None] + k_dec[:, :, c].transpose(-1, -2) @ U
    out = out.reshape(S, Hv, nc * l, Dv).transpose(1, 2)  # (S, Lpad, H, Dv)
    return out[seq_id, pos], state.contiguous()


# ----------------------------------------------------------------------------------------------
# single-token decode
# ----------------------------------------------------------------------------------------------


def gated_delta_rule_update_ref(states, q, k, v, g, beta, state_indices, *, scale=None, use_qk_l2norm=False):
    """Reference: per-sequence loop.

    states: (num_slots, Hv, Dk, Dv) cache (any strides), updated in place in its own dtype;
    q, k: (B, Hk, Dk); v: (B, Hv, Dv); g, beta: (B, Hv); state_indices: (B,) int64.
    Returns out: (B, Hv, Dv) float32.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    return delta_rule_update_loop(states, q, k, v, g[..., None], beta, state_indices)


def delta_rule_update_loop(states, q, k, v, log_decay, beta, state_indices):
    """One delta-rule step per sequence on prepared float32 inputs, updating ``states`` (num_slots, H, Dk, Dv)
    in place in its own dtype; ``log_decay`` (B, H, 1) per head or (B, H, Dk) per key channel (see
    :func:`delta_rule_varlen_loop`). Returns out: (B, H, Dv) float32."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # (B, H, Dv)
    for b in range(v.shape[0]):
        slot = int(state_indices[b])
        state = read_slot(states, slot) * log_decay[b].exp()[:, :, None]  # (H, Dk, Dv)
        kv_mem = (state * k[b][:, :, None]).sum(1)  # (H, Dv)
        u = beta[b][:, None] * (v[b] - kv_mem)
        state = state + k[b][:, :, None] * u[:, None, :]
        out[b] = (state * q[b][:, :, None]).sum(1)
        write_slot(states, slot, state)
    return out


def gated_delta_rule_update(states, q, k, v, g, beta, state_indices, *, scale=None, use_qk_l2norm=False):
    """Fast path, vectorized over the batch (slots in state_indices must be distinct).

    Arguments and results: as ``gated_delta_rule_update_ref``.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    idx = state_indices.to(device=states.device, dtype=torch.long)  # (B,)
    state = read_slots(states, idx) * g.exp()[:, :, None, None]  # (B, Hv, Dk, Dv)
    kv_mem = (state * k[..., None]).sum(2)  # (B, Hv, Dv)
    u = beta[..., None] * (v - kv_mem)  # (B, Hv, Dv)
    state = state + k[..., None] * u[:, :, None, :]
    out = (state * q[..., None]).sum(2)  # (B, Hv, Dv)
    write_slots(states, idx, state)  # in place into the cache
    return out
