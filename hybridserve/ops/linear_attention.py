"""Linear attention with a per-head constant decay (MiniMax "lightning" attention).

Per sequence and head h, with a decay rate s_h >= 0 and a state S of shape (Dk, Dv):
    S_t = exp(-s_h) * S_{t-1} + k_t (outer) v_t
    o_t = q_t . S_t                      (no softmax, no scale: the caller scales q if it wants)

``decay`` is the rate s (H,), not the factor exp(-s). A sequence without an initial state starts
from S = 0. Math is float32; outputs are float32; cache writes are cast to the cache's dtype.
"""

from __future__ import annotations

import torch

from hybridserve.cache.slots import read_slot, read_slots, write_slot, write_slots
from hybridserve.ops._varlen import packed_positions

# ----------------------------------------------------------------------------------------------
# varlen prefill
# ----------------------------------------------------------------------------------------------


def linear_attention_varlen_ref(q, k, v, decay, cu_seqlens, initial_states, chunk_size=64):
    """Reference: token-by-token recurrence (chunk_size is ignored).

    q, k: (T, H, Dk); v: (T, H, Dv) packed tokens of S sequences; decay: (H,) rate s >= 0;
    cu_seqlens: (S+1,) int64; initial_states: (S, H, Dk, Dv) or None (zeros).
    Returns out: (T, H, Dv) float32 and final_states: (S, H, Dk, Dv) float32.
    """
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = cu_seqlens.numel() - 1
    factor = torch.exp(-decay.float())[:, None, None]  # (H, 1, 1)
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=q.device)  # (T, H, Dv)
    final = torch.empty(S, H, Dk, Dv, dtype=torch.float32, device=q.device)  # (S, H, Dk, Dv)
    for s in range(S):
        if initial_states is None:
            state = torch.zeros(H, Dk, Dv, dtype=torch.float32, device=q.device)  # (H, Dk, Dv)
        else:
            state = initial_states[s].float()  # (H, Dk, Dv)
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            state = factor * state + k[t].float()[:, :, None] * v[t].float()[:, None, :]  # (H, Dk, Dv)
            out[t] = torch.einsum("hk,hkv->hv", q[t].float(), state)  # (H, Dv)
        final[s] = state
    return out, final


def linear_attention_varlen(q, k, v, decay, cu_seqlens, initial_states, chunk_size=64):
    """Fast path: chunked, vectorized over sequences padded to a multiple of chunk_size.

    Inside a chunk the output is the quadratic form (q k^T * decay mask) v plus the incoming
    state's contribution; the state is passed from chunk to chunk (a loop over chunks, not tokens).
    Decay exponents are integer step counts times s, so padded steps (after a sequence's end)
    neither decay nor add to the state.

    Arguments and results: as ``linear_attention_varlen_ref``.
    """
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = cu_seqlens.numel() - 1
    dev = q.device
    _, lens, seq_id, pos = packed_positions(cu_seqlens, T, dev)  # pos: position within its sequence
    l = chunk_size
    nc = max(-(-int(lens.max()) // l), 1) if S > 0 else 1  # chunks per padded sequence

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(S, nc * l, *t.shape[1:], dtype=torch.float32, device=dev)
        out[seq_id, pos] = t.float()
        return out.view(S, nc, l, *t.shape[1:])

    qp, kp, vp = pad(q), pad(k), pad(v)  # (S, c, l, H, D)
    rate = decay.float().to(dev)[None, None, :, None]  # (1, 1, H, 1)

    # steps[s, c, i]: real tokens of chunk c up to and including position i (padding adds none)
    valid = (lens[:, None] - torch.arange(nc, device=dev)[None, :] * l).clamp(0, l)  # (S, c)
    steps = torch.minimum(torch.arange(1, l + 1, device=dev)[None, None, :], valid[:, :, None]).float()  # (S, c, l)
    q_decay = torch.exp(-rate * steps[:, :, None, :])  # (S, c, H, l): chunk start -> position i
    k_decay = torch.exp(-rate * (valid[:, :, None, None] - steps[:, :, None, :]))  # (S, c, H, l): j -> chunk end
    chunk_decay = torch.exp(-rate[..., 0] * valid[:, :, None].float())  # (S, c, H)

    # 1. intra-chunk: (q k^T * exp(-s (i - j)) for j <= i) v
    gap = steps[:, :, :, None] - steps[:, :, None, :]  # (S, c, l, l) [i, j]
    causal = torch.ones(l, l, dtype=torch.bool, device=dev).tril()  # (l, l)
    mask = torch.where(causal, torch.exp(-rate[..., None] * gap[:, :, None]), 0.0)  # (S, c, H, l, l)
    scores = torch.einsum("sclhk,scjhk->schlj", qp, kp) * mask  # (S, c, H, l, l)
    out = torch.einsum("schlj,scjhv->sclhv", scores, vp)  # (S, c, l, H, Dv)

    # 2. each chunk's own contribution to the state at its end (from a zero state)
    chunk_kv = torch.einsum("scjhk,schj,scjhv->schkv", kp, k_decay, vp)  # (S, c, H, Dk, Dv)

    # 3. state passing across chunks, and the incoming state's contribution to every position
    if initial_states is None:
        state = torch.zeros(S, H, Dk, Dv, dtype=torch.float32, device=dev)  # (S, H, Dk, Dv)
    else:
        state = initial_states.float()  # (S, H, Dk, Dv)
    for c in range(nc):
        out[:, c] += torch.einsum("slhk,shl,shkv->slhv", qp[:, c], q_decay[:, c], state)  # (S, l, H, Dv)
        state = state * chunk_decay[:, c, :, None, None] + chunk_kv[:, c]  # (S, H, Dk, Dv)

    y = out.reshape(S, nc * l, H, Dv)[seq_id, pos]  # (T, H, Dv)
    return y, state.contiguous()


# ----------------------------------------------------------------------------------------------
# single-token decode
# ----------------------------------------------------------------------------------------------


def linear_attention_update_ref(states, q, k, v, decay, state_indices):
    """Reference: per-sequence loop.

    states: (num_slots, H, Dk, Dv) cache, updated in place (may be a strided view);
    q, k: (B, H, Dk); v: (B, H, Dv) one new token per sequence; decay: (H,) rate s >= 0;
    state_indices: (B,) int64.
    Returns out: (B, H, Dv) float32 (computed from the float32 new state, before the cache cast).
    """
    B, H, _ = q.shape
    factor = torch.exp(-decay.float())[:, None, None]  # (H, 1, 1)
    out = torch.empty(B, H, v.shape[-1], dtype=torch.float32, device=q.device)  # (B, H, Dv)
    for b in range(B):
        slot = int(state_indices[b])
        state = factor * read_slot(states, slot) + k[b].float()[:, :, None] * v[b].float()[:, None, :]
        out[b] = torch.einsum("hk,hkv->hv", q[b].float(), state)  # (H, Dv)
        write_slot(states, slot, state)
    return out


def linear_attention_update(states, q, k, v, decay, state_indices):
    """Fast path, vectorized over the batch (slots in state_indices must be distinct).

    Arguments and results: as ``linear_attention_update_ref``.
    """
    idx = state_indices.to(device=states.device, dtype=torch.long)  # (B,)
    factor = torch.exp(-decay.float().to(states.device))[None, :, None, None]  # (1, H, 1, 1)
    state = factor * read_slots(states, idx) + k.float()[..., :, None] * v.float()[..., None, :]  # (B, H, Dk, Dv)
    out = torch.einsum("bhk,bhkv->bhv", q.float(), state)  # (B, H, Dv)
    write_slots(states, idx, state)  # in place into the cache
    return out
