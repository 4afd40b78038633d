"""The Mamba2 mixer's recurrent part as one op entry: causal conv, then the SSD scan, over pooled state.

Pool-in-place contract: :func:`mamba2_conv_scan` reads the conv and SSM states of a sequence group at its
slots (``group.state_indices``) of the pool views, writes their new values there in place, and writes the
scan output into the group's rows of ``y``. Two bodies, chosen in ``ops/dispatch.py``: the CPU kernels
(``kernels/recurrent.py``: conv, then the scan) and plain PyTorch (``ops/causal_conv1d.py``, ``ops/ssd.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.state_codec import CodedState, StateView
from hybridserve.forward_batch import SeqGroup
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.kernels import recurrent_coded
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.coded_plain import any_coded, float_states
from hybridserve.ops.dispatch import call
from hybridserve.ops.prepared import prepared
from hybridserve.ops.ssd import mamba2_chunk_scan_varlen, mamba2_state_update


class Mamba2Weights(Protocol):
    """What the op reads of a Mamba2 layer: its sizes and its conv and SSM parameters."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    intermediate: int
    chunk_size: int
    activation: str
    conv1d: nn.Conv1d  # depthwise, weight (conv_dim, 1, K)
    A_log: torch.Tensor  # (H,)
    D: torch.Tensor  # (H,)
    dt_bias: torch.Tensor  # (H,)


def mamba2_conv_scan(layer: Mamba2Weights, group: SeqGroup, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
                     conv_states: torch.Tensor, ssm_states: StateView, *, decode: bool,
                     dt_limit: tuple[float, float]) -> None:
    """Conv + SSD scan of one sequence group, in place.

    xbc: (T, conv_dim) and dt: (T, H) of the whole batch; y: (T, H, P) float32, its ``group.tokens`` rows
    written; conv_states: (slots, conv_dim, K-1) and ssm_states: (slots, H, P, N) pool views, the group's slots
    read and written. ``decode``: every sequence of the group has one token (the single-step update).
    """
    args = (layer, group, xbc, dt, y, conv_states, ssm_states, decode, dt_limit)
    call("mamba2_conv_scan", lambda: _kernel_body(*args), lambda: _plain(*args), xbc, ssm_states)


def _kernel_params(layer: Mamba2Weights) -> tuple[torch.Tensor | None, ...]:
    """The float32 parameters the CPU kernels take: conv weight (K, conv_dim) tap-major, conv bias or None,
    A = -exp(A_log), D, dt_bias (each (H,))."""
    conv = layer.conv1d

    def build() -> tuple[torch.Tensor | None, ...]:
        bias = conv.bias
        return (recurrent_kernels.tap_major(conv.weight),  # (K, conv_dim)
                None if bias is None else bias.detach().float().contiguous(),
                -torch.exp(layer.A_log.detach().float()), layer.D.detach().float().contiguous(),
                layer.dt_bias.detach().float().contiguous())

    return prepared(layer, "_mamba2_kernel_params", (conv.weight, conv.bias, layer.A_log, layer.D, layer.dt_bias),
                    build)


def _kernel_body(layer: Mamba2Weights, g: SeqGroup, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
                 conv_states: torch.Tensor, ssm_states: StateView, decode: bool,
                 dt_limit: tuple[float, float]) -> bool:
    """The CPU-kernel body (the scan over an 8-bit state: ``kernels/recurrent_coded.py``); False when declined
    before any state changed."""
    H, P, G, N = layer.num_heads, layer.head_dim, layer.n_groups, layer.d_state
    n, idx = g.num_tokens, g.state_indices
    if isinstance(ssm_states, CodedState):
        if not recurrent_coded.group_ok(ssm_states, (H, P, N), xbc.dtype, g.rounding_keys, g.seq_lens, idx):
            return False
    elif not recurrent_kernels.scan_state_supported(ssm_states, xbc.dtype):
        return False
    conv_w, conv_b, A32, D32, dt_bias32 = _kernel_params(layer)
    conv_out = recurrent_kernels.causal_conv1d(xbc[g.tokens], conv_states, conv_w, conv_b, g.cu_seqlens_q, idx,
                                               layer.activation)  # (n, conv_dim)
    if conv_out is None:
        return False
    xs, B, C = torch.split(conv_out, [layer.intermediate, G * N, G * N], dim=-1)
    y_g = y[g.tokens].view(n, H * P)
    if isinstance(ssm_states, CodedState):
        scanned = recurrent_coded.mamba2_scan(ssm_states, xs, dt[g.tokens], A32, B, C, D32, dt_bias32, True, dt_limit,
                                              g.cu_seqlens_q, idx, g.rounding_keys, g.seq_lens, y_g)
    else:
        scanned = recurrent_kernels.mamba2_scan(ssm_states, xs, dt[g.tokens], A32, B, C, D32, dt_bias32, True,
                                                dt_limit, g.cu_seqlens_q, idx, y_g)
    if scanned:
        return True
    # the state was checked above and the other arguments are built here: a decline is a bug
    raise RuntimeError("the CPU conv kernel ran but the scan kernel declined the same group")


def _plain(layer: Mamba2Weights, g: SeqGroup, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
           conv_states: torch.Tensor, ssm_states: StateView, decode: bool, dt_limit: tuple[float, float]) -> bool:
    """The PyTorch body on float views of the states (8-bit ones decoded for the call: ops/coded_plain.py)."""
    if not any_coded(conv_states, ssm_states):  # float states: read and written in place
        return _plain_body(layer, g, xbc, dt, y, conv_states, ssm_states, decode, dt_limit)
    with float_states((g,), (conv_states, ssm_states)) as ((local_group,), (conv_local, ssm_local)):
        assert local_group is not None
        return _plain_body(layer, local_group, xbc, dt, y, conv_local, ssm_local, decode, dt_limit)


def _plain_body(layer: Mamba2Weights, g: SeqGroup, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
                conv_states: torch.Tensor, ssm_states: torch.Tensor, decode: bool,
                dt_limit: tuple[float, float]) -> bool:
    """The PyTorch body (``ops/causal_conv1d.py``, ``ops/ssd.py``)."""
    H, P, G, N = layer.num_heads, layer.head_dim, layer.n_groups, layer.d_state
    n, idx = g.num_tokens, g.state_indices
    conv = layer.conv1d
    weight = conv.weight.squeeze(1)  # (conv_dim, K)
    A = -torch.exp(layer.A_log.float())  # (H,)
    if decode:
        conv_out = causal_conv1d_update(xbc[g.tokens], conv_states, weight, conv.bias, idx,
                                        layer.activation)  # (n, conv_dim)
        xs, B, C = torch.split(conv_out, [layer.intermediate, G * N, G * N], dim=-1)
        y[g.tokens] = mamba2_state_update(
            ssm_states, xs.reshape(n, H, P), dt[g.tokens], A, B.reshape(n, G, N), C.reshape(n, G, N),
            layer.D, layer.dt_bias, True, dt_limit, idx)
        return True
    conv_out, conv_final = causal_conv1d_varlen(xbc[g.tokens], weight, conv.bias, g.cu_seqlens_q,
                                                read_slots(conv_states, idx), layer.activation)
    write_slots(conv_states, idx, conv_final)
    xs, B, C = torch.split(conv_out, [layer.intermediate, G * N, G * N], dim=-1)
    y_p, ssm_final = mamba2_chunk_scan_varlen(
        xs.reshape(n, H, P), dt[g.tokens], A, B.reshape(n, G, N), C.reshape(n, G, N), layer.chunk_size,
        layer.D, layer.dt_bias, True, dt_limit, g.cu_seqlens_q, read_slots(ssm_states, idx))
    write_slots(ssm_states, idx, ssm_final)
    y[g.tokens] = y_p
    return True
