"""Mamba2 SSD (state-space duality) scan and single-token state update.

Per sequence, with heads h sharing B/C group g = h // (H // G):
    dt_t = clamp(softplus(dt_t + dt_bias), lo, hi)            (softplus optional)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t    h: (H, P, N)
    y_t  = h_t . C_t + D * x_t

Math is float32; y is float32; cache writes are cast to the cache's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridserve.cache.slots import read_slot, read_slots, write_slot, write_slots
from hybridserve.ops._varlen import packed_positions


def _process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt: (..., H) -> float32 (..., H) after bias, optional softplus and clamp."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """Stable segment sum. x: (..., L) -> (..., L, L) with out[i, j] = sum(x[j+1..i]) for j <= i
    and -inf above the diagonal (cumsum of masked copies, no difference of large cumsums)."""
    L = x.shape[-1]
    xx = x[..., None].expand(*x.shape, L)  # (..., L, L): xx[i, j] = x[i]
    below = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)
    xx = xx.masked_fill(~below, 0.0)
    seg = torch.cumsum(xx, dim=-2)  # (..., L, L)
    on_or_below = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(0)
    return seg.masked_fill(~on_or_below, -math.inf)


# ----------------------------------------------------------------------------------------------
# varlen chunked scan
# ----------------------------------------------------------------------------------------------


def mamba2_chunk_scan_varlen_ref(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit,
                                 cu_seqlens, initial_states):
    """Reference: token-by-token recurrence (chunk_size is ignored).

    x: (T, H, P); dt: (T, H); A: (H,); B, C: (T, G, N); D, dt_bias: (H,) or None;
    cu_seqlens: (S+1,) int64; initial_states: (S, H, P, N) or None.
    Returns y: (T, H, P) float32 and final_states: (S, H, P, N) float32.
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = cu_seqlens.numel() - 1
    rep = H // G
    dtp = _process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (T, H)
    Af = A.float()  # (H,)
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)  # (T, H, P)
    final = torch.empty(S, H, P, N, dtype=torch.float32, device=x.device)  # (S, H, P, N)
    for s in range(S):
        if initial_states is None:
            h = torch.zeros(H, P, N, dtype=torch.float32, device=x.device)  # (H, P, N)
        else:
            h = initial_states[s].float()  # (H, P, N)
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            xt = x[t].float()  # (H, P)
            Bt = B[t].float().repeat_interleave(rep, dim=0)  # (H, N)
            Ct = C[t].float().repeat_interleave(rep, dim=0)  # (H, N)
            decay = torch.exp(dtp[t] * Af)  # (H,)
            h = decay[:, None, None] * h + (dtp[t][:, None] * xt)[:, :, None] * Bt[:, None, :]
            yt = (h * Ct[:, None, :]).sum(-1)  # (H, P)
            if D is not None:
                yt = yt + D.float()[:, None] * xt
            y[t] = yt
        final[s] = h
    return y, final


def mamba2_chunk_scan_varlen(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit,
                             cu_seqlens, initial_states):
    """Fast path: chunked SSD, vectorized over sequences padded to a multiple of chunk_size
    (padded steps have dt = 0, so they leave the state unchanged).

    Arguments and results: as ``mamba2_chunk_scan_varlen_ref``.
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    S = cu_seqlens.numel() - 1
    dev = x.device
    _, lens, seq_id, pos = packed_positions(cu_seqlens, T, dev)  # pos: position within its sequence
    Lmax = int(lens.max())
    # The result does not depend on the chunk size (only rounding does), so batches of short
    # sequences use a shorter chunk instead of padding each one to a full chunk.
    l = min(chunk_size, -(-Lmax // 16) * 16)
    nc = -(-Lmax // l)  # chunks per padded sequence

    # pack -> pad
    dtp = _process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (T, H)

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(S, nc * l, *t.shape[1:], dtype=torch.float32, device=dev)
        out[seq_id, pos] = t.float()
        return out.view(S, nc, l, *t.shape[1:])

    xdt = pad(x * dtp[:, :, None])  # (S, c, l, H, P), x already scaled by dt
    xdt = xdt.view(S, nc, l, G, R, P)  # (S, c, l, G, R, P)
    dtA = pad(dtp * A.float()).permute(0, 1, 3, 2)  # (S, c, H, l); 0 on padded steps
    Bp = pad(B)  # (S, c, l, G, N)
    Cp = pad(C)  # (S, c, l, G, N)

    A_cum = torch.cumsum(dtA, dim=-1)  # (S, c, H, l)

    # 1. intra-chunk (diagonal blocks): quadratic attention-like form
    Lmat = torch.exp(_segsum(dtA)).view(S, nc, G, R, l, l)  # (S, c, G, R, l, l) [target, source]
    CB = torch.einsum("sclgn,scjgn->scglj", Cp, Bp)  # (S, c, G, l, l)
    M = Lmat * CB[:, :, :, None]  # (S, c, G, R, l, l)
    y_diag = torch.einsum("scgrlj,scjgrp->sclgrp", M, xdt)  # (S, c, l, G, R, P)

    # 2. state contributed by each chunk (starting from zero), at the chunk's end
    decay_to_end = torch.exp(A_cum[..., -1:] - A_cum).view(S, nc, G, R, l)  # (S, c, G, R, l)
    chunk_states = torch.einsum("scjgn,scgrj,scjgrp->scgrpn", Bp, decay_to_end, xdt)
    chunk_states = chunk_states.reshape(S, nc, H, P, N)  # (S, c, H, P, N)

    # 3. inter-chunk recurrence (state passing) as one decay matrix over chunk boundaries
    if initial_states is None:
        init = torch.zeros(S, 1, H, P, N, dtype=torch.float32, device=dev)  # (S, 1, H, P, N)
    else:
        init = initial_states.float()[:, None]  # (S, 1, H, P, N)
    states = torch.cat([init, chunk_states], dim=1)  # (S, c+1, H, P, N)
    chunk_decay = F.pad(A_cum[..., -1].transpose(1, 2), (1, 0))  # (S, H, c+1)
    chunk_decay = torch.exp(_segsum(chunk_decay))  # (S, H, c+1, c+1)
    states = torch.einsum("shzc,schpn->szhpn", chunk_decay, states)  # (S, c+1, H, P, N)
    final = states[:, -1].contiguous()  # (S, H, P, N)
    states_in = states[:, :-1].reshape(S, nc, G, R, P, N)  # (S, c, G, R, P, N) entering chunk

    # 4. contribution of the incoming state to each position of the chunk
    decay_from_start = torch.exp(A_cum).view(S, nc, G, R, l)  # (S, c, G, R, l)
    y_off = torch.einsum("sclgn,scgrpn,scgrl->sclgrp", Cp, states_in, decay_from_start)

    y_pad = (y_diag + y_off).reshape(S, nc * l, H, P)  # (S, Lpad, H, P)
    y = y_pad[seq_id, pos]  # (T, H, P)
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y, final


# ----------------------------------------------------------------------------------------------
# single-token decode
# ----------------------------------------------------------------------------------------------


def mamba2_state_update_ref(ssm_states, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit,
                            state_indices):
    """Reference: per-sequence loop.

    ssm_states: (num_slots, H, P, N) cache, updated in place; x: (B, H, P); dt: (B, H); A: (H,);
    B, C: (B, G, N); D, dt_bias: (H,) or None; state_indices: (B,) int64.
    Returns y: (B, H, P) float32 (computed from the float32 new state, before the cache cast).
    """
    Bsz, H, P = x.shape
    rep = H // B.shape[1]
    dtp = _process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (B, H)
    y = torch.empty(Bsz, H, P, dtype=torch.float32, device=x.device)  # (B, H, P)
    for b in range(Bsz):
        slot = int(state_indices[b])
        h = read_slot(ssm_states, slot)  # (H, P, N)
        xb = x[b].float()  # (H, P)
        Bb = B[b].float().repeat_interleave(rep, dim=0)  # (H, N)
        Cb = C[b].float().repeat_interleave(rep, dim=0)  # (H, N)
        decay = torch.exp(dtp[b] * A.float())  # (H,)
        h = decay[:, None, None] * h + (dtp[b][:, None] * xb)[:, :, None] * Bb[:, None, :]
        yb = (h * Cb[:, None, :]).sum(-1)  # (H, P)
        if D is not None:
            yb = yb + D.float()[:, None] * xb
        y[b] = yb
        write_slot(ssm_states, slot, h)
    return y


def mamba2_state_update(ssm_states, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit,
                        state_indices):
    """Fast path, vectorized over the batch (slots in state_indices must be distinct).

    Arguments and results: as ``mamba2_state_update_ref``.
    """
    Bsz, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    idx = state_indices.to(device=ssm_states.device, dtype=torch.long)  # (B,)
    dtp = _process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (B, H)
    h = read_slots(ssm_states, idx).view(Bsz, G, R, P, N)  # (B, G, R, P, N)
    xf = x.float()  # (B, H, P)
    decay = torch.exp(dtp * A.float()).view(Bsz, G, R, 1, 1)  # (B, G, R, 1, 1)
    xdt = (xf * dtp[:, :, None]).view(Bsz, G, R, P, 1)  # (B, G, R, P, 1)
    h = h.mul_(decay).addcmul_(xdt, B.float().view(Bsz, G, 1, 1, N))  # (B, G, R, P, N), in place
    y = torch.einsum("bgrpn,bgn->bgrp", h, C.float()).reshape(Bsz, H, P)  # (B, H, P)
    if D is not None:
        y = y + D.float()[:, None] * xf
    write_slots(ssm_states, idx, h.reshape(Bsz, H, P, N))  # in place into the cache
    return y
