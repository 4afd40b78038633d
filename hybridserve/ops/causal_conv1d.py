"""Depthwise causal 1-D convolution (the short conv of Mamba1/Mamba2, short-conv and GDN layers).

Convention (same as ``torch.nn.Conv1d(groups=D, padding=K-1)`` truncated to the input length,
which is what HF Mamba2 does): the window of token t is the K most recent inputs, oldest first,
and the last kernel tap ``weight[:, K-1]`` multiplies the current token. A conv state holds the
K-1 most recent inputs of a sequence, oldest first, shape (D, K-1).

Math is float32; outputs are cast to x.dtype; cache writes are cast to the cache's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.cache.slots import read_slot, read_slots, write_slot, write_slots
from hybridserve.ops._varlen import packed_positions


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"unknown activation {activation!r}; allowed: None, 'silu'")


def _last_cols(t: torch.Tensor, n: int) -> torch.Tensor:
    """Last n columns of t (..., M); n may be 0 (t[..., -0:] would be the whole tensor)."""
    return t[..., t.shape[-1] - n:]


# ----------------------------------------------------------------------------------------------
# varlen prefill
# ----------------------------------------------------------------------------------------------


def causal_conv1d_varlen_ref(x, weight, bias, cu_seqlens, initial_states, activation):
    """Reference: per-sequence, per-token loop.

    x: (T, D) packed tokens of S sequences; weight: (D, K); bias: (D,) or None;
    cu_seqlens: (S+1,) int64; initial_states: (S, D, K-1) or None (zeros); activation: None|"silu".
    Returns y: (T, D) in x.dtype and final_states: (S, D, K-1) float32.
    """
    T, D = x.shape
    K = weight.shape[1]
    S = cu_seqlens.numel() - 1
    w = weight.float()  # (D, K)
    y = torch.empty(T, D, dtype=torch.float32, device=x.device)  # (T, D)
    final = torch.empty(S, D, K - 1, dtype=torch.float32, device=x.device)  # (S, D, K-1)
    for s in range(S):
        start, end = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        if initial_states is None:
            init = torch.zeros(D, K - 1, dtype=torch.float32, device=x.device)  # (D, K-1)
        else:
            init = initial_states[s].float()  # (D, K-1)
        stream = torch.cat([init, x[start:end].float().T], dim=1)  # (D, K-1+L)
        for t in range(end - start):
            window = stream[:, t:t + K]  # (D, K), oldest first
            out = (window * w).sum(dim=1)  # (D,)
            if bias is not None:
                out = out + bias.float()
            y[start + t] = _activate(out, activation)
        final[s] = _last_cols(stream, K - 1)
    return y.to(x.dtype), final


def causal_conv1d_varlen(x, weight, bias, cu_seqlens, initial_states, activation):
    """Fast path, vectorized over all tokens: K gathers from one (initial states ++ tokens) buffer.

    Arguments and results: as ``causal_conv1d_varlen_ref``.
    """
    T, D = x.shape
    K = weight.shape[1]
    S = cu_seqlens.numel() - 1
    dev = x.device
    cu, lens, seq_id, pos = packed_positions(cu_seqlens, T, dev)  # pos: position within its sequence
    if initial_states is None:
        init = torch.zeros(S, K - 1, D, dtype=torch.float32, device=dev)  # (S, K-1, D)
    else:
        init = initial_states.float().transpose(1, 2)  # (S, K-1, D)
    # Rows [0, S*(K-1)) hold the initial states (seq s at s*(K-1) + j), then the T tokens.
    buf = torch.cat([init.reshape(S * (K - 1), D), x.float()], dim=0)  # (S*(K-1)+T, D)

    def rows(seq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Buffer row of stream position p (0..K-2 = initial state, K-1.. = tokens) of seq."""
        in_init = p < K - 1
        init_row = seq * (K - 1) + p.clamp(max=max(K - 2, 0))
        tok_row = S * (K - 1) + cu[seq] + (p - (K - 1)).clamp(min=0)
        return torch.where(in_init, init_row, tok_row)

    w = weight.float()  # (D, K)
    acc = torch.zeros(T, D, dtype=torch.float32, device=dev)  # (T, D)
    for k in range(K):  # kernel taps, not tokens
        acc += buf[rows(seq_id, pos + k)] * w[:, k]  # (T, D)
    if bias is not None:
        acc += bias.float()
    y = _activate(acc, activation).to(x.dtype)  # (T, D)

    # Final state: stream positions L .. L+K-2 of each sequence.
    p_final = lens[:, None] + torch.arange(K - 1, device=dev)  # (S, K-1)
    seq_f = torch.arange(S, device=dev)[:, None].expand_as(p_final)  # (S, K-1)
    final = buf[rows(seq_f, p_final)].transpose(1, 2).contiguous()  # (S, D, K-1)
    return y, final


# ----------------------------------------------------------------------------------------------
# single-token decode
# ----------------------------------------------------------------------------------------------


def causal_conv1d_update_ref(x, conv_states, weight, bias, state_indices, activation):
    """Reference: per-sequence loop.

    x: (B, D) one new token per sequence; conv_states: (num_slots, D, K-1) cache, updated in place;
    weight: (D, K); bias: (D,) or None; state_indices: (B,) int64; activation: None|"silu".
    Returns y: (B, D) in x.dtype.
    """
    B, D = x.shape
    K = weight.shape[1]
    y = torch.empty(B, D, dtype=torch.float32, device=x.device)  # (B, D)
    for b in range(B):
        slot = int(state_indices[b])
        window = torch.cat([read_slot(conv_states, slot), x[b].float()[:, None]], dim=1)  # (D, K)
        out = (window * weight.float()).sum(dim=1)  # (D,)
        if bias is not None:
            out = out + bias.float()
        y[b] = _activate(out, activation)
        write_slot(conv_states, slot, _last_cols(window, K - 1))
    return y.to(x.dtype)


def causal_conv1d_update(x, conv_states, weight, bias, state_indices, activation):
    """Fast path, vectorized over the batch (slots in state_indices must be distinct).

    Arguments and results: as ``causal_conv1d_update_ref``.
    """
    K = weight.shape[1]
    idx = state_indices.to(device=conv_states.device, dtype=torch.long)  # (B,)
    state = read_slots(conv_states, idx)  # (B, D, K-1)
    window = torch.cat([state, x.float()[:, :, None]], dim=2)  # (B, D, K)
    out = (window * weight.float()).sum(dim=2)  # (B, D)
    if bias is not None:
        out = out + bias.float()
    if K > 1:
        write_slots(conv_states, idx, window[:, :, 1:])  # in place into the cache
    return _activate(out, activation).to(x.dtype)
