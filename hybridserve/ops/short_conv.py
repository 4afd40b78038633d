"""LFM2's gated short convolution as one op entry: ``c * conv(b * x)``, a depthwise causal conv without
activation over pooled conv state.

Pool-in-place contract: :func:`gated_short_conv` reads each sequence group's conv state at its slots
(``state_indices``) of the pool view and writes the new windows there in place. Two bodies, chosen in
``ops/dispatch.py``: the CPU kernels (``kernels/pointwise.py: mul``, ``kernels/recurrent.py: causal_conv1d``)
and plain PyTorch (``ops/causal_conv1d.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.state_codec import StateView
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.coded_plain import any_coded, float_states_of_batch
from hybridserve.ops.dispatch import call
from hybridserve.ops.prepared import prepared


def gated_short_conv(conv: nn.Conv1d, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                     conv_states: StateView) -> torch.Tensor:
    """b, c, x: (T, D) -> ``c * conv(b * x)`` (T, D); conv: depthwise, weight (D, 1, K); conv_states:
    (slots, D, K-1) pool view (or an 8-bit one: cache/conv_codec.py), the batch's slots read and written."""
    return call("short_conv", lambda: _kernel_body(conv, b, c, x, batch, conv_states),
                lambda: _plain(conv, b, c, x, batch, conv_states), b, conv_states)


def _plain(conv: nn.Conv1d, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
           conv_states: StateView) -> torch.Tensor:
    """The PyTorch body on a float view of the conv state (an 8-bit one decoded for the call: ops/coded_plain.py)."""
    if not any_coded(conv_states):  # a float state: read and written in place
        return _plain_body(conv, b, c, x, batch, conv_states)
    with float_states_of_batch(batch, (conv_states,)) as (local_batch, (conv_local,)):
        return _plain_body(conv, b, c, x, local_batch, conv_local)


def _plain_body(conv: nn.Conv1d, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                conv_states: torch.Tensor) -> torch.Tensor:
    """The PyTorch body."""
    bx = b * x  # (T, D)
    weight = conv.weight.squeeze(1)  # (D, K)
    y = torch.empty_like(bx)  # (T, D)
    if batch.decode is not None:
        g = batch.decode
        y[g.tokens] = causal_conv1d_update(bx[g.tokens], conv_states, weight, conv.bias, g.state_indices, None)
    if batch.prefill is not None:
        g = batch.prefill
        idx = g.state_indices
        y_p, final = causal_conv1d_varlen(bx[g.tokens], weight, conv.bias, g.cu_seqlens_q,
                                          read_slots(conv_states, idx), None)
        write_slots(conv_states, idx, final)
        y[g.tokens] = y_p
    return c * y


def _kernel_body(conv: nn.Conv1d, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                 conv_states: StateView) -> torch.Tensor | None:
    """The CPU-kernel body, per sequence group; None when declined before any state changed."""
    bias = conv.bias
    weight_t, bias32 = prepared(conv, "_short_conv_kernel_params", (conv.weight, bias),
                                lambda: (recurrent_kernels.tap_major(conv.weight),  # (K, D) float32
                                         None if bias is None else bias.detach().float().contiguous()))
    bx = pointwise_kernels.mul(b, x)  # (T, D)
    if bx is None or not recurrent_kernels.conv_supported(conv_states, weight_t, bias32, bx.dtype, None):
        return None
    y = torch.empty_like(bx)  # (T, D)
    for g in batch.groups:
        if recurrent_kernels.causal_conv1d(bx[g.tokens], conv_states, weight_t, bias32, g.cu_seqlens_q,
                                           g.state_indices, None, out=y[g.tokens]) is None:
            raise RuntimeError("the short conv kernel declined a group after another ran")
    out = pointwise_kernels.mul(c, y)
    if out is None:
        raise RuntimeError("the short conv's gate kernel declined after the conv ran")
    return out
