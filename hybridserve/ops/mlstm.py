"""The mLSTM cell (xLSTM's matrix memory): chunkwise varlen prefill and single-token update.

Per sequence and head, with a matrix memory C (Dk, Dv), a normalizer n (Dk,) and a max state m
(a scalar that keeps the exponential gates in range), from the (soft-capped) input and forget gate
pre-activations i_t, f_t and q_t, k_t, v_t:

    logf_t = logsigmoid(f_t)
    m_t    = max(logf_t + m_{t-1}, i_t)
    C_t    = exp(logf_t + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T
    n_t    = exp(logf_t + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t    = (q_t' C_t) / (max(|q_t' . n_t|, exp(-m_t)) + eps)      q_t' = q_t Dk^-1/2

Chunkwise form (b = within-chunk cumsum of logf, (C0, n0, m0) the incoming state): unrolling the
recurrence, m_t = max(b_t + m0, max_{j<=t} (b_t - b_j + i_j)), the same maximum the steps take, and

    num_t = exp(b_t + m0 - m_t) q_t' C0 + sum_{j<=t} exp(b_t - b_j + i_j - m_t) (q_t' . k_j) v_j
    den_t = exp(b_t + m0 - m_t) q_t' . n0 + sum_{j<=t} exp(b_t - b_j + i_j - m_t) (q_t' . k_j)

so a prefill ends in the state token-by-token stepping reaches (up to float32 rounding). A zero
state (a fresh slot) is HF's initial state. Math is float32; outputs are float32; cache writes are
cast to the cache's dtype.

The state is defined up to a common scale: (C e^-d, n e^-d, m + d) gives the same outputs and the same
future (h is unchanged, and so is C e^m). Stored in a 16-bit dtype, m is rounded (by up to 0.03 at
|m| ~ 10 in bf16, a 3% change of the memory's weight against new tokens); :func:`fit_max_state` moves
that rounding into C and n, so the stored m loses nothing and only C and n carry their own rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.cache.slots import read_slot, read_slots, write_slot, write_slots
from hybridserve.ops._varlen import packed_positions


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in x's dtype (each op rounded as PyTorch rounds it); x itself for None."""
    return x if cap is None else cap * torch.tanh(x / cap)


def _step(C, n, m, q, k, v, i, f, eps):
    """One step for a batch of heads: C (B, H, Dk, Dv), n (B, H, Dk), m (B, H) float32; q, k (B, H, Dk),
    v (B, H, Dv), i, f (B, H) float32. Returns h (B, H, Dv) and the new (C, n, m)."""
    logf = F.logsigmoid(f)  # (B, H)
    m_new = torch.maximum(logf + m, i)
    fa = torch.exp(logf + m - m_new)[..., None]  # (B, H, 1)
    ia = torch.exp(i - m_new)[..., None]
    C = fa[..., None] * C + ia[..., None] * (k[..., :, None] * v[..., None, :])  # (B, H, Dk, Dv)
    n = fa * n + ia * k  # (B, H, Dk)
    qs = q * q.shape[-1] ** -0.5
    num = (qs[..., None, :] @ C).squeeze(-2)  # (B, H, Dv)
    den = (qs * n).sum(-1, keepdim=True)  # (B, H, 1)
    h = num / (torch.maximum(den.abs(), torch.exp(-m_new)[..., None]) + eps)
    return h, C, n, m_new


def fit_max_state(C: torch.Tensor, n: torch.Tensor, m: torch.Tensor, dtype: torch.dtype):
    """The same state with m exactly representable in ``dtype``: C (..., Dk, Dv), n (..., Dk), m (...)
    float32 -> C e^(m - m'), n e^(m - m'), m' = m rounded to dtype (all float32; unchanged for float32)."""
    m_fit = m.to(dtype).float()
    if dtype == torch.float32:
        return C, n, m_fit
    scale = torch.exp(m - m_fit)  # (...)
    return C * scale[..., None, None], n * scale[..., None], m_fit


def _initial(states, S, H, Dk, Dv, device):
    """(C, n, m) float32 of S sequences from ``states`` (a (C, n, m) tuple) or zeros when None."""
    if states is None:
        return (torch.zeros(S, H, Dk, Dv, device=device), torch.zeros(S, H, Dk, device=device),
                torch.zeros(S, H, device=device))
    return tuple(s.float() for s in states)


# ----------------------------------------------------------------------------------------------
# varlen prefill
# ----------------------------------------------------------------------------------------------


def mlstm_varlen_ref(q, k, v, i, f, cu_seqlens, initial_states, *, eps=1e-6, chunk_size=64):
    """Reference: token-by-token recurrence (chunk_size is ignored).

    q, k: (T, H, Dk); v: (T, H, Dv); i, f: (T, H) gate pre-activations (after any soft cap);
    cu_seqlens: (S+1,) int64; initial_states: (C (S, H, Dk, Dv), n (S, H, Dk), m (S, H)) or None (zeros).
    Returns h: (T, H, Dv) float32 and the final (C, n, m), float32.
    """
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = cu_seqlens.numel() - 1
    q, k, v, i, f = (t.float() for t in (q, k, v, i, f))
    C0, n0, m0 = _initial(initial_states, S, H, Dk, Dv, q.device)
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=q.device)  # (T, H, Dv)
    finals = [torch.empty_like(C0), torch.empty_like(n0), torch.empty_like(m0)]
    for s in range(S):
        C, n, m = C0[s:s + 1], n0[s:s + 1], m0[s:s + 1]  # batch of one
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            h, C, n, m = _step(C, n, m, q[t:t + 1], k[t:t + 1], v[t:t + 1], i[t:t + 1], f[t:t + 1], eps)
            out[t] = h[0]
        finals[0][s], finals[1][s], finals[2][s] = C[0], n[0], m[0]
    return out, tuple(finals)


def mlstm_varlen(q, k, v, i, f, cu_seqlens, initial_states, *, eps=1e-6, chunk_size=64):
    """Fast path: the chunkwise form, vectorized over sequences padded to a multiple of the chunk
    (padded steps have logf = 0 and i = -inf: they neither decay nor add to the state).

    Arguments and results: as ``mlstm_varlen_ref``.
    """
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = cu_seqlens.numel() - 1
    dev = q.device
    _, lens, seq_id, pos = packed_positions(cu_seqlens, T, dev)
    Lmax = int(lens.max()) if S else 0
    l = max(min(chunk_size, Lmax), 1)  # one short chunk when every sequence fits in it
    nc = -(-Lmax // l)

    def pad(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """(T, H, ...) -> (S, H, c, l, ...), ``fill`` past each sequence's end."""
        out = torch.full((S, nc * l, *t.shape[1:]), fill, dtype=torch.float32, device=dev)
        out[seq_id, pos] = t.float()
        out = out.view(S, nc, l, *t.shape[1:])
        return out.permute(0, 3, 1, 2, *range(4, out.dim()))

    qc = pad(q.float() * Dk ** -0.5)  # (S, H, c, l, Dk) scaled queries
    kc, vc = pad(k), pad(v)  # (S, H, c, l, Dk|Dv)
    ic = pad(i, float("-inf"))  # (S, H, c, l)
    bc = pad(F.logsigmoid(f.float())).cumsum(-1)  # (S, H, c, l) log forget from the chunk start
    causal = torch.ones(l, l, dtype=torch.bool, device=dev).tril()  # [t, j]: j <= t

    C, n, m = _initial(initial_states, S, H, Dk, Dv, dev)
    out = torch.empty(S, H, nc, l, Dv, dtype=torch.float32, device=dev)  # (S, H, c, l, Dv)
    for c in range(nc):  # chunks, not tokens
        b, ig, qq, kk, vv = bc[:, :, c], ic[:, :, c], qc[:, :, c], kc[:, :, c], vc[:, :, c]
        log_d = (b[..., :, None] - b[..., None, :] + ig[..., None, :]).masked_fill(~causal, float("-inf"))
        m_inter = b + m[..., None]  # (S, H, l)
        m_t = torch.maximum(m_inter, log_d.amax(-1))  # (S, H, l): the steps' max state
        d = torch.exp(log_d - m_t[..., None])  # (S, H, l, l)
        inter = torch.exp(m_inter - m_t)  # (S, H, l)
        scores = (qq @ kk.transpose(-1, -2)) * d  # (S, H, l, l)
        num = inter[..., None] * (qq @ C) + scores @ vv  # (S, H, l, Dv)
        den = inter * (qq @ n[..., None]).squeeze(-1) + scores.sum(-1)  # (S, H, l)
        out[:, :, c] = num / (torch.maximum(den.abs(), torch.exp(-m_t)) + eps)[..., None]
        m_end = m_t[..., -1]  # (S, H)
        w = torch.exp(b[..., -1:] - b + ig - m_end[..., None])  # (S, H, l) each token's weight at the end
        decay = torch.exp(b[..., -1] + m - m_end)  # (S, H)
        kw = kk * w[..., None]  # (S, H, l, Dk)
        C = decay[..., None, None] * C + kw.transpose(-1, -2) @ vv
        n = decay[..., None] * n + kw.sum(-2)
        m = m_end
    out = out.reshape(S, H, nc * l, Dv).transpose(1, 2)  # (S, Lpad, H, Dv)
    return out[seq_id, pos], (C.contiguous(), n.contiguous(), m.contiguous())


# ----------------------------------------------------------------------------------------------
# single-token decode
# ----------------------------------------------------------------------------------------------


def mlstm_update_ref(states, q, k, v, i, f, state_indices, *, eps=1e-6):
    """Reference: per-sequence loop.

    states: (C (num_slots, H, Dk, Dv), n (num_slots, H, Dk), m (num_slots, H)) cache views (any strides),
    updated in place in their own dtype (m stored exactly: :func:`fit_max_state`); q, k: (B, H, Dk);
    v: (B, H, Dv); i, f: (B, H); state_indices: (B,) int64. Returns h: (B, H, Dv) float32.
    """
    Cs, ns, ms = states
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # (B, H, Dv)
    for b in range(v.shape[0]):
        slot = int(state_indices[b])
        h, C, n, m = _step(*(read_slot(s, slot)[None] for s in states),
                           q[b:b + 1].float(), k[b:b + 1].float(), v[b:b + 1].float(), i[b:b + 1].float(),
                           f[b:b + 1].float(), eps)
        out[b] = h[0]
        C, n, m = fit_max_state(C, n, m, ms.dtype)
        for cache, value in zip(states, (C[0], n[0], m[0])):
            write_slot(cache, slot, value)
    return out


def mlstm_update(states, q, k, v, i, f, state_indices, *, eps=1e-6):
    """Fast path, vectorized over the batch (slots in state_indices must be distinct).

    Arguments and results: as ``mlstm_update_ref``.
    """
    idx = state_indices.to(device=v.device, dtype=torch.long)  # (B,)
    Cs, ns, ms = states
    h, C, n, m = _step(read_slots(Cs, idx), read_slots(ns, idx), read_slots(ms, idx), q.float(), k.float(),
                       v.float(), i.float(), f.float(), eps)
    C, n, m = fit_max_state(C, n, m, ms.dtype)
    write_slots(Cs, idx, C)
    write_slots(ns, idx, n)
    write_slots(ms, idx, m)
    return h
