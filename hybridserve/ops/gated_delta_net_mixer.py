"""The gated delta net mixer's recurrent part (Qwen3-Next's linear attention) as one op entry: the projections
split into the conv input and the gate z, the causal conv, the gated delta rule and the norm gated by z.

Pool-in-place contract: :func:`gated_delta_net_mix` reads the conv and recurrent states of each sequence group
of the batch at its slots (``state_indices``) of the pool views and writes their new values there in place. Two
bodies, chosen in ``ops/dispatch.py``: the CPU kernels (``kernels/recurrent.py``: split, conv, delta rule;
``kernels/pointwise.py``: the gated norm) and plain PyTorch (``ops/causal_conv1d.py``, ``ops/gated_delta.py``
and the layer's norm module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.state_codec import CodedState, StateView
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.kernels import recurrent_coded
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.coded_plain import any_coded, float_states_of_batch
from hybridserve.ops.dispatch import call
from hybridserve.ops.gated_delta import gated_delta_rule_update, gated_delta_rule_varlen
from hybridserve.ops.prepared import prepared


class NormThenGate(Protocol):
    """``weight * rms_norm(x)`` then times ``silu(gate)`` (``layers/gated_deltanet.py: NormThenGateRMSNorm``)."""

    weight: torch.Tensor
    eps: float
    __call__: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GatedDeltaNetWeights(Protocol):
    """What the op reads of a gated delta net layer: its sizes and its conv, decay and norm parameters."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    key_dim: int
    value_dim: int
    activation: str
    chunk_size: int
    beta_scale: float
    conv1d: nn.Conv1d  # depthwise, weight (conv_dim, 1, K), no bias
    A_log: torch.Tensor  # (Hv,)
    dt_bias: torch.Tensor  # (Hv,)
    norm: NormThenGate


def gated_delta_net_mix(layer: GatedDeltaNetWeights, qkvz: torch.Tensor, ba: torch.Tensor, batch: ForwardBatch,
                        conv_states: torch.Tensor, rec_states: StateView, dtype: torch.dtype) -> torch.Tensor:
    """The mixer between its input and output projections, over the batch's state slots in place.

    qkvz: (T, Hk (2 Dk + 2 R Dv)), per key head ``[q | k | v | z]``; ba: (T, 2 Hv), per key head ``[b | a]``;
    conv_states: (slots, conv_dim, K-1) and rec_states: (slots, Hv, Dk, Dv) pool views.
    Returns the normed, gated output (T, Hv Dv) in ``dtype``.
    """
    args = (layer, qkvz, ba, batch, conv_states, rec_states, dtype)
    return call("gated_delta_net", lambda: _kernel_body(*args), lambda: _plain(*args), qkvz, rec_states)


def _split(layer: GatedDeltaNetWeights, qkvz: torch.Tensor, ba: torch.Tensor):
    """-> mixed qkv (T, conv_dim) ``[all q | all k | all v]``, z (T, Hv, Dv), b, a (T, Hv)."""
    t = qkvz.shape[0]
    Hk, Dk, Dv = layer.num_k_heads, layer.head_k_dim, layer.head_v_dim
    R = layer.num_v_heads // Hk
    q, k, v, z = torch.split(qkvz.view(t, Hk, 2 * Dk + 2 * R * Dv), [Dk, Dk, R * Dv, R * Dv], dim=-1)
    b, a = torch.split(ba.view(t, Hk, 2 * R), [R, R], dim=-1)
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # (T, conv_dim)
    return (mixed, z.reshape(t, layer.num_v_heads, Dv), b.reshape(t, layer.num_v_heads),
            a.reshape(t, layer.num_v_heads))


def _plain(layer: GatedDeltaNetWeights, qkvz: torch.Tensor, ba: torch.Tensor, batch: ForwardBatch,
           conv_states: torch.Tensor, rec_states: StateView, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body on float views of the states (8-bit ones decoded for the call: ops/coded_plain.py)."""
    if not any_coded(conv_states, rec_states):  # float states: read and written in place
        return _plain_body(layer, qkvz, ba, batch, conv_states, rec_states, dtype)
    with float_states_of_batch(batch, (conv_states, rec_states)) as (local_batch, (conv_local, rec_local)):
        return _plain_body(layer, qkvz, ba, local_batch, conv_local, rec_local, dtype)


def _plain_body(layer: GatedDeltaNetWeights, qkvz: torch.Tensor, ba: torch.Tensor, batch: ForwardBatch,
                conv_states: torch.Tensor, rec_states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body."""
    t = qkvz.shape[0]
    Hk, Hv, Dk, Dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    mixed, z, b, a = _split(layer, qkvz, ba)
    beta = b.float().sigmoid()  # (T, Hv)
    if layer.beta_scale != 1.0:
        beta = beta * layer.beta_scale
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())  # (T, Hv) log decay
    conv = layer.conv1d
    weight = conv.weight.squeeze(1)  # (conv_dim, K)
    out = torch.empty(t, Hv, Dv, dtype=torch.float32, device=qkvz.device)  # (T, Hv, Dv)

    def heads(conv_out: torch.Tensor):
        n = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        return q.reshape(n, Hk, Dk), k.reshape(n, Hk, Dk), v.reshape(n, Hv, Dv)

    if batch.decode is not None:
        grp = batch.decode
        conv_out = causal_conv1d_update(mixed[grp.tokens], conv_states, weight, conv.bias, grp.state_indices,
                                        layer.activation)  # (B, conv_dim)
        q, k, v = heads(conv_out)
        out[grp.tokens] = gated_delta_rule_update(rec_states, q, k, v, g[grp.tokens], beta[grp.tokens],
                                                  grp.state_indices, use_qk_l2norm=True)
    if batch.prefill is not None:
        grp = batch.prefill
        idx = grp.state_indices
        conv_out, conv_final = causal_conv1d_varlen(mixed[grp.tokens], weight, conv.bias, grp.cu_seqlens_q,
                                                    read_slots(conv_states, idx), layer.activation)
        write_slots(conv_states, idx, conv_final)
        q, k, v = heads(conv_out)
        out_p, rec_final = gated_delta_rule_varlen(q, k, v, g[grp.tokens], beta[grp.tokens], grp.cu_seqlens_q,
                                                   read_slots(rec_states, idx), use_qk_l2norm=True,
                                                   chunk_size=layer.chunk_size)
        write_slots(rec_states, idx, rec_final)
        out[grp.tokens] = out_p
    y = layer.norm(out.to(dtype).reshape(t * Hv, Dv), z.reshape(t * Hv, Dv))  # (T*Hv, Dv)
    return y.reshape(t, Hv * Dv)


def _kernel_body(layer: GatedDeltaNetWeights, qkvz: torch.Tensor, ba: torch.Tensor, batch: ForwardBatch,
                 conv_states: torch.Tensor, rec_states: StateView,
                 dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU-kernel body: the split into the conv input and z, the conv, the gated delta rule per group (over
    an 8-bit state: ``kernels/recurrent_coded.py``) into (T, Hv Dv) in ``dtype``, the gated norm; None when
    declined before any state changed."""
    t, Hk, Hv, Dk, Dv = qkvz.shape[0], layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    conv = layer.conv1d
    conv_w, A_log, dt_bias = prepared(
        layer, "_gated_delta_net_kernel_params", (conv.weight, layer.A_log, layer.dt_bias),
        lambda: (recurrent_kernels.tap_major(conv.weight), layer.A_log.detach().float().contiguous(),
                 layer.dt_bias.detach().float().contiguous()))
    split = recurrent_kernels.gdn_split(qkvz, Hk, Dk, (Hv // Hk) * Dv)
    if split is None or not recurrent_kernels.conv_supported(conv_states, conv_w, None, dtype, layer.activation):
        return None
    coded = isinstance(rec_states, CodedState)
    if coded and not all(recurrent_coded.group_ok(rec_states, (Hv, Dk, Dv), dtype, g.rounding_keys, g.seq_lens,
                                                  g.state_indices) for g in batch.groups):
        return None
    mixed, z = split  # (T, conv_dim), (T, Hv Dv)
    out = torch.empty(t, Hv * Dv, dtype=dtype)
    for i, g in enumerate(batch.groups):
        conv_out = recurrent_kernels.causal_conv1d(mixed[g.tokens], conv_states, conv_w, None, g.cu_seqlens_q,
                                                   g.state_indices, layer.activation)
        if conv_out is None or not (
                recurrent_coded.gated_delta_rule(rec_states, conv_out, ba[g.tokens], A_log, dt_bias, True,
                                                 g.cu_seqlens_q, g.state_indices, g.rounding_keys, g.seq_lens,
                                                 out[g.tokens], Hk, layer.beta_scale) if coded
                else recurrent_kernels.gated_delta_rule(rec_states, conv_out, ba[g.tokens], A_log, dt_bias, True,
                                                        g.cu_seqlens_q, g.state_indices, out[g.tokens], Hk,
                                                        layer.beta_scale)):
            if i == 0 and conv_out is None:
                return None
            raise RuntimeError("a gated delta net kernel declined after another ran")
    y = pointwise_kernels.norm_then_gate(out.view(t * Hv, Dv), layer.norm.weight, layer.norm.eps,
                                         z.view(t * Hv, Dv))
    if y is None:
        raise RuntimeError("the gated norm kernel declined after the recurrence ran")
    return y.view(t, Hv * Dv)
