"""The Mamba1 mixer's recurrent part as one op entry: causal conv, the scan inputs (x_proj into dt, B, C, the
family's norms on them, dt_proj without its bias) and the selective scan gated by z.

Pool-in-place contract: :func:`mamba1_mix` reads each sequence group's conv and SSM states at its slots
(``state_indices``) of the pool views and writes their new values there in place. Two bodies, chosen in
``ops/dispatch.py``: the CPU kernels (``kernels/recurrent.py``: conv, scan; ``kernels/pointwise.py``: the
weightless norms; ``kernels/gemm.py``: dt_proj in float32 sums) and plain PyTorch (``ops/causal_conv1d.py``,
``ops/selective_scan.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.state_codec import CodedState, StateView
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm, recurrent_coded
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.coded_plain import any_coded, float_states_of_batch
from hybridserve.ops.dispatch import call
from hybridserve.ops.prepared import prepared
from hybridserve.ops.selective_scan import selective_scan_varlen, selective_state_update

Norm = Callable[[torch.Tensor], torch.Tensor]


class Mamba1Weights(Protocol):
    """What the op reads of a Mamba1 layer (``layers/mamba1.py: Mamba1Mixer``)."""

    intermediate: int
    d_state: int
    dt_rank: int
    activation: str
    bcdt_norm: str | None  # None, "weighted" (the three norm modules below) or "weightless" (eps norm_eps)
    norm_eps: float
    conv1d: nn.Conv1d  # depthwise, weight (inter, 1, K)
    x_proj: Callable[[torch.Tensor], torch.Tensor]  # (n, inter) -> (n, dt_rank + 2 N)
    dt_proj: nn.Linear  # (dt_rank -> inter), its bias added in the scan
    A_log: torch.Tensor  # (inter, N)
    D: torch.Tensor  # (inter,)
    dt_layernorm: Norm
    b_layernorm: Norm
    c_layernorm: Norm
    scan_inputs: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # the plain dt, B, C


def mamba1_mix(layer: Mamba1Weights, xs: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
               conv_states: torch.Tensor, ssm_states: StateView, dtype: torch.dtype) -> torch.Tensor:
    """The mixer between ``in_proj`` and ``out_proj``, over the batch's state slots in place.

    xs, gate: (T, inter) halves of the input projection; conv_states: (slots, inter, K-1) and ssm_states:
    (slots, inter, N) pool views. Returns the gated scan output y (T, inter) in ``dtype``.
    """
    args = (layer, xs, gate, batch, conv_states, ssm_states, dtype)
    return call("mamba1_conv_scan", lambda: _kernel_body(*args), lambda: _plain(*args), xs, ssm_states)


def _plain(layer: Mamba1Weights, xs: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
           conv_states: torch.Tensor, ssm_states: StateView, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body on float views of the states (8-bit ones decoded for the call: ops/coded_plain.py)."""
    if not any_coded(conv_states, ssm_states):  # float states: read and written in place
        return _plain_body(layer, xs, gate, batch, conv_states, ssm_states, dtype)
    with float_states_of_batch(batch, (conv_states, ssm_states)) as (local_batch, (conv_local, ssm_local)):
        return _plain_body(layer, xs, gate, local_batch, conv_local, ssm_local, dtype)


def _plain_body(layer: Mamba1Weights, xs: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                conv_states: torch.Tensor, ssm_states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body."""
    conv = layer.conv1d
    weight = conv.weight.squeeze(1)  # (inter, K)
    conv_out = torch.empty_like(xs)  # (T, inter)
    if batch.decode is not None:
        g = batch.decode
        conv_out[g.tokens] = causal_conv1d_update(xs[g.tokens], conv_states, weight, conv.bias, g.state_indices,
                                                  layer.activation)
    if batch.prefill is not None:
        g = batch.prefill
        idx = g.state_indices
        conv_out[g.tokens], conv_final = causal_conv1d_varlen(
            xs[g.tokens], weight, conv.bias, g.cu_seqlens_q, read_slots(conv_states, idx), layer.activation)
        write_slots(conv_states, idx, conv_final)
    dt, B, C = layer.scan_inputs(conv_out)
    A = -torch.exp(layer.A_log.float())  # (inter, N)
    y = torch.empty(xs.shape[0], layer.intermediate, dtype=torch.float32, device=xs.device)  # (T, inter)
    if batch.decode is not None:
        g = batch.decode
        t = g.tokens
        y[t] = selective_state_update(ssm_states, conv_out[t], dt[t], A, B[t], C[t], layer.D, gate[t],
                                      layer.dt_proj.bias, True, g.state_indices)
    if batch.prefill is not None:
        g = batch.prefill
        t, idx = g.tokens, g.state_indices
        y[t], ssm_final = selective_scan_varlen(conv_out[t], dt[t], A, B[t], C[t], layer.D, gate[t],
                                                layer.dt_proj.bias, True, g.cu_seqlens_q, read_slots(ssm_states, idx))
        write_slots(ssm_states, idx, ssm_final)
    return y.to(dtype)


def _kernel_params(layer: Mamba1Weights, dtype: torch.dtype) -> tuple:
    """float32 parameters the kernels take: the conv weight (K, inter) tap-major and bias, A = -exp(A_log)
    (inter, N), D, dt_bias, the dt_proj weight, and ones in ``dtype`` for the weightless norms."""
    conv, dt_proj = layer.conv1d, layer.dt_proj

    def build() -> tuple:
        bias = conv.bias
        return (recurrent_kernels.tap_major(conv.weight), None if bias is None else bias.detach().float().contiguous(),
                -torch.exp(layer.A_log.detach().float()).contiguous(), layer.D.detach().float().contiguous(),
                dt_proj.bias.detach().float().contiguous(), dt_proj.weight.detach().float().contiguous(),
                torch.ones(max(layer.dt_rank, layer.d_state), dtype=dtype))

    sources = (conv.weight, conv.bias, layer.A_log, layer.D, dt_proj.bias, dt_proj.weight)
    return prepared(layer, "_mamba1_kernel_params", sources, build, dtype)


def _kernel_body(layer: Mamba1Weights, xs: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                 conv_states: torch.Tensor, ssm_states: StateView,
                 dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU-kernel body, per sequence group: conv, x_proj, the dt/B/C norms, dt_proj (float32 sums, rounded
    as ``layers/dense.py: linear``), the scan (over an 8-bit state: ``kernels/recurrent_coded.py``) into y in
    ``dtype``; None when a kernel declines before any state changed."""
    conv_w, conv_b, A, D, dt_bias, dt_w32, ones = _kernel_params(layer, dtype)
    coded = isinstance(ssm_states, CodedState)
    if not recurrent_kernels.conv_supported(conv_states, conv_w, conv_b, dtype, layer.activation):
        return None
    if coded and not all(recurrent_coded.group_ok(ssm_states, (layer.intermediate, layer.d_state), dtype,
                                                  g.rounding_keys, g.seq_lens, g.state_indices)
                         for g in batch.groups):
        return None
    if not coded and ssm_states.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    y = torch.empty(xs.shape[0], layer.intermediate, dtype=dtype)  # (T, inter)
    for g in batch.groups:
        conv_out = recurrent_kernels.causal_conv1d(xs[g.tokens], conv_states, conv_w, conv_b, g.cu_seqlens_q,
                                                   g.state_indices, layer.activation)  # (n, inter)
        if conv_out is None:
            return None
        ts, B, C = torch.split(layer.x_proj(conv_out), [layer.dt_rank, layer.d_state, layer.d_state], dim=-1)
        if layer.bcdt_norm == "weighted":
            ts, B, C = layer.dt_layernorm(ts), layer.b_layernorm(B), layer.c_layernorm(C)
        elif layer.bcdt_norm == "weightless":  # x / rms(x): a norm whose float32 weight multiply is by 1
            ts, B, C = (pointwise_kernels.rms_norm(t, ones[:t.shape[1]], layer.norm_eps, weight_in_float32=True)
                        for t in (ts, B, C))
        dt = None if ts is None else gemm.linear_f32(ts, dt_w32, dtype)  # (n, inter) raw, no bias
        if dt is None or B is None or C is None:
            raise RuntimeError("the Mamba1 conv kernel ran but a later kernel declined the same group")
        if coded:
            scanned = recurrent_coded.mamba1_scan(ssm_states, conv_out, dt, A, B, C, D, gate[g.tokens], dt_bias,
                                                  True, g.cu_seqlens_q, g.state_indices, g.rounding_keys, g.seq_lens,
                                                  y[g.tokens])
        else:
            scanned = recurrent_kernels.mamba1_scan(ssm_states, conv_out, dt, A, B, C, D, gate[g.tokens], dt_bias,
                                                    True, g.cu_seqlens_q, g.state_indices, y[g.tokens])
        if not scanned:
            raise RuntimeError("the Mamba1 conv kernel ran but a later kernel declined the same group")
    return y
