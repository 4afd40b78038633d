"""Mamba1 selective scan over packed variable-length sequences, and its single-token state update.

Per sequence, for every channel d of the inner dimension and state index n (no heads, no groups):
    dt_t    = softplus(dt_t + dt_bias)                          (bias and softplus optional)
    h_t     = exp(dt_t * A) * h_{t-1} + dt_t * x_t * B_t        h: (D, N)
    y_t     = h_t . C_t + D * x_t
    y_t     = y_t * silu(z_t)                                   (gate optional)

Shapes follow HF's ``MambaMixer`` with the batch and length axes packed into one token axis T:
x, dt, z: (T, D) (HF (B, D, L)), A: (D, N) (already ``-exp(A_log)``), B, C: (T, N) (HF (B, N, L)),
D, dt_bias: (D,), states (S, D, N). ``dt`` is the raw ``dt_proj.weight @ time_step`` (no bias).

Math is float32; y is float32; cache writes are cast to the cache's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridserve.cache.slots import read_slot, read_slots, write_slot, write_slots
from hybridserve.ops._varlen import packed_positions


def _process_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """dt: (..., D) -> float32 (..., D) after the optional bias and softplus."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt


def _output(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """Skip connection and gate on the float32 scan output y (..., D)."""
    if D is not None:
        y = y + D.float() * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


# ----------------------------------------------------------------------------------------------
# varlen prefill
# ----------------------------------------------------------------------------------------------


def selective_scan_varlen_ref(x, dt, A, B, C, D, z, dt_bias, dt_softplus, cu_seqlens, initial_states):
    """Reference: token-by-token recurrence, one sequence at a time.

    x: (T, D); dt: (T, D) raw; A: (D, N); B, C: (T, N); D: (D,) or None; z: (T, D) or None;
    dt_bias: (D,) or None; dt_softplus: bool; cu_seqlens: (S+1,) int64;
    initial_states: (S, D, N) or None (zeros).
    Returns y: (T, D) float32 and final_states: (S, D, N) float32.
    """
    T, Dm = x.shape
    N = A.shape[1]
    S = cu_seqlens.numel() - 1
    dtp = _process_dt(dt, dt_bias, dt_softplus)  # (T, D)
    Af = A.float()  # (D, N)
    y = torch.empty(T, Dm, dtype=torch.float32, device=x.device)  # (T, D)
    final = torch.empty(S, Dm, N, dtype=torch.float32, device=x.device)  # (S, D, N)
    for s in range(S):
        if initial_states is None:
            h = torch.zeros(Dm, N, dtype=torch.float32, device=x.device)  # (D, N)
        else:
            h = initial_states[s].float()  # (D, N)
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            h = torch.exp(dtp[t][:, None] * Af) * h + (dtp[t] * x[t].float())[:, None] * B[t].float()[None, :]
            y[t] = h @ C[t].float()  # (D,)
        final[s] = h
    return _output(y, x, D, z), final


#: Elements of one (sequence, block, step, channel, state) work buffer per channel tile: bounds the
#: prefill's memory (two such float32 buffers, 16 MiB each) whatever the prompt length and width.
TILE_ELEMS = 1 << 22


def _block_len(max_len: int) -> int:
    """Block length l minimising the sequential steps (l within a block + max_len / l across blocks)."""
    return max(1, math.isqrt(max(max_len, 1) - 1) + 1)


def _blocked_scan(dt, u, A, B, C, h0):
    """Blocked scan of one channel tile. dt, u = dt*x: (S, nb, l, d) float32, 0 on padded steps;
    A: (d, N); B, C: (S, nb, l, N); h0: (S, d, N). Returns y (S, nb, l, d) and final state (S, d, N)."""
    S, nb, l, d = dt.shape
    decay = (dt[..., None] * A.float()).exp_()  # (S, nb, l, d, N) one-step decay, in (0, 1]
    h = u[..., None] * B[:, :, :, None, :]  # (S, nb, l, d, N) dt * x * B

    # 1. inside every block from a zero state: h[j] <- decay[j] * h[j-1] + h[j]; meanwhile decay[j]
    #    becomes the running product from the block start (in (0, 1]: it can only underflow, to 0)
    for j in range(1, l):
        h[:, :, j].addcmul_(decay[:, :, j], h[:, :, j - 1])
        decay[:, :, j].mul_(decay[:, :, j - 1])
    cum = decay  # (S, nb, l, d, N)

    # 2. across blocks: the state entering each block; the one leaving the last block is final
    state = h0  # (S, d, N)
    h_in = torch.empty(S, nb, d, h.shape[-1], dtype=torch.float32, device=dt.device)  # (S, nb, d, N)
    for c in range(nb):
        h_in[:, c] = state
        state = cum[:, c, -1] * state + h[:, c, -1]

    # 3. the full state at every step, read out by C
    h.addcmul_(cum, h_in[:, :, None])  # (S, nb, l, d, N)
    y = torch.einsum("sbldn,sbln->sbld", h, C)  # (S, nb, l, d)
    return y, state


def selective_scan_varlen(x, dt, A, B, C, D, z, dt_bias, dt_softplus, cu_seqlens, initial_states):
    """Fast path: a blocked scan, vectorized over all sequences and all blocks.

    Sequences are padded to ``nb`` blocks of ``l ~ sqrt(max_len)`` steps (padded steps have dt = 0,
    so they leave the state unchanged). Three stages, ``l + nb`` sequential steps in all (45 for a
    500-token prompt instead of 500):
      1. within each block, from a zero state: ``l`` steps, each over every (sequence, block),
         keeping the running product of the one-step decays ``exp(dt*A)`` from the block start;
      2. across blocks: ``nb`` steps over sequences, the incoming state times the block's total
         decay plus the block's local end state;
      3. every step adds its block's incoming state times the decay from the block start, then
         reads C.
    Channels are independent, so the work runs in channel tiles of at most ``TILE_ELEMS`` elements
    per (S, nb*l, d, N) buffer: memory stays bounded for long prompts and wide models.

    Arguments and results: as ``selective_scan_varlen_ref``.
    """
    T, Dm = x.shape
    N = A.shape[1]
    S = cu_seqlens.numel() - 1
    dev = x.device
    _, lens, seq_id, pos = packed_positions(cu_seqlens, T, dev)  # pos: position within its sequence
    max_len = int(lens.max()) if S > 0 else 0
    l = _block_len(max_len)
    nb = -(-max_len // l)

    dtp = _process_dt(dt, dt_bias, dt_softplus)  # (T, D)

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(S, nb * l, t.shape[1], dtype=torch.float32, device=dev)
        out[seq_id, pos] = t.float()
        return out.view(S, nb, l, t.shape[1])

    dt_pad = pad(dtp)  # (S, nb, l, D)
    u_pad = pad(dtp * x.float())  # (S, nb, l, D)
    B_pad, C_pad = pad(B), pad(C)  # (S, nb, l, N)
    if initial_states is None:
        h0 = torch.zeros(S, Dm, N, dtype=torch.float32, device=dev)  # (S, D, N)
    else:
        h0 = initial_states.float()  # (S, D, N)
    y_pad = torch.empty(S, nb, l, Dm, dtype=torch.float32, device=dev)  # (S, nb, l, D)
    final = torch.empty(S, Dm, N, dtype=torch.float32, device=dev)  # (S, D, N)
    tile = max(1, TILE_ELEMS // max(S * nb * l * N, 1))
    for d0 in range(0, Dm, tile):
        ch = slice(d0, d0 + tile)
        y_pad[..., ch], final[:, ch] = _blocked_scan(dt_pad[..., ch], u_pad[..., ch], A[ch], B_pad, C_pad,
                                                     h0[:, ch])
    y = y_pad.view(S, nb * l, Dm)[seq_id, pos]  # (T, D)
    return _output(y, x, D, z), final


# ----------------------------------------------------------------------------------------------
# single-token decode
# ----------------------------------------------------------------------------------------------


def selective_state_update_ref(ssm_states, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices):
    """Reference: per-sequence loop.

    ssm_states: (num_slots, D, N) cache (any float dtype, may be a strided view), updated in place;
    x: (B, D); dt: (B, D) raw; A: (D, N); B, C: (B, N); D: (D,) or None; z: (B, D) or None;
    dt_bias: (D,) or None; dt_softplus: bool; state_indices: (B,) int64.
    Returns y: (B, D) float32 (computed from the float32 new state, before the cache cast).
    """
    Bsz, Dm = x.shape
    dtp = _process_dt(dt, dt_bias, dt_softplus)  # (B, D)
    y = torch.empty(Bsz, Dm, dtype=torch.float32, device=x.device)  # (B, D)
    for b in range(Bsz):
        slot = int(state_indices[b])
        h = read_slot(ssm_states, slot)  # (D, N)
        h = torch.exp(dtp[b][:, None] * A.float()) * h + (dtp[b] * x[b].float())[:, None] * B[b].float()[None, :]
        y[b] = h @ C[b].float()
        write_slot(ssm_states, slot, h)
    return _output(y, x, D, z)


def selective_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices):
    """Fast path, vectorized over the batch (slots in state_indices must be distinct).

    Arguments and results: as ``selective_state_update_ref``.
    """
    idx = state_indices.to(device=ssm_states.device, dtype=torch.long)  # (B,)
    dtp = _process_dt(dt, dt_bias, dt_softplus)  # (B, D)
    h = read_slots(ssm_states, idx)  # (B, D, N)
    h = torch.exp(dtp[:, :, None] * A.float()) * h + (dtp * x.float())[:, :, None] * B.float()[:, None, :]
    y = torch.einsum("bdn,bn->bd", h, C.float())  # (B, D)
    write_slots(ssm_states, idx, h)  # in place into the cache
    return _output(y, x, D, z)
