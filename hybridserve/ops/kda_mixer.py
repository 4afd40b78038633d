"""Kimi delta attention's recurrent part as one op entry: the causal conv of q, k and v, the KDA recurrence
(per-channel decay, l2-normed q and k) and the sigmoid-gated norm.

Pool-in-place contract: :func:`kda_mix` reads each sequence group's conv and recurrent states at its slots
(``state_indices``) of the pool views and writes their new values there in place. Two bodies, chosen in
``ops/dispatch.py``: the CPU kernels (``kernels/recurrent.py``: the conv of each of q, k, v over its own
channels of the conv state, then ``kda`` with the norm fused) and plain PyTorch (``ops/causal_conv1d.py``,
``ops/kda.py`` and the layer's forget-gate and norm modules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.state_codec import CodedState, StateView
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.kernels import recurrent_coded
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.coded_plain import any_coded, float_states_of_batch
from hybridserve.ops.dispatch import call
from hybridserve.ops.kda import kda_update, kda_varlen
from hybridserve.ops.prepared import prepared


class ForgetGate(Protocol):
    """``layers/kda.py: KimiForgetGate``: ``decay(f)`` turns the raw forget projection (T, H Dk) into the
    per-channel log decay (T, H, Dk) float32."""

    A_log: torch.Tensor  # (1, 1, H, 1)
    dt_bias: torch.Tensor  # (H Dk,)
    decay: Callable[[torch.Tensor], torch.Tensor]


class SigmoidGatedNorm(Protocol):
    """``weight * rms_norm(x) * sigmoid(gate)`` (``layers/kda.py: SigmoidGatedRMSNorm``)."""

    weight: torch.Tensor
    eps: float
    __call__: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class KdaWeights(Protocol):
    """What the op reads of a Kimi delta attention layer."""

    num_heads: int
    head_dim: int
    qkv_dim: int
    activation: str
    chunk_size: int
    conv1d: nn.Conv1d  # depthwise over [q | k | v], weight (3 H D, 1, K), no bias
    forget_gate: ForgetGate
    o_norm: SigmoidGatedNorm


def kda_mix(layer: KdaWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
            gate: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor, rec_states: StateView,
            dtype: torch.dtype) -> torch.Tensor:
    """The mixer between its projections and ``o_proj``, over the batch's state slots in place.

    q, k, v: (T, H D) projections before the conv; f: (T, H D) raw forget projection; b: (T, H) raw beta
    projection; gate: (T, H D) the norm's gate; conv_states: (slots, 3 H D, K-1) and rec_states:
    (slots, H, D, D) pool views. Returns (T, H D) in ``dtype``.
    """
    args = (layer, q, k, v, f, b, gate, batch, conv_states, rec_states, dtype)
    return call("kda", lambda: _kernel_body(*args), lambda: _plain(*args), q, rec_states)


def _plain(layer: KdaWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
           b: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
           rec_states: StateView, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body on float views of the states (8-bit ones decoded for the call: ops/coded_plain.py)."""
    if not any_coded(conv_states, rec_states):  # float states: read and written in place
        return _plain_body(layer, q, k, v, f, b, gate, batch, conv_states, rec_states, dtype)
    with float_states_of_batch(batch, (conv_states, rec_states)) as (local_batch, (conv_local, rec_local)):
        return _plain_body(layer, q, k, v, f, b, gate, local_batch, conv_local, rec_local, dtype)


def _plain_body(layer: KdaWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                b: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                rec_states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body."""
    t, H, D = q.shape[0], layer.num_heads, layer.head_dim
    mixed = torch.cat([q, k, v], dim=-1)  # (T, 3 H D)
    g = layer.forget_gate.decay(f)  # (T, H, D) float32
    beta = b.float().sigmoid()  # (T, H)
    weight = layer.conv1d.weight.squeeze(1)  # (conv_dim, K)
    out = torch.empty(t, H, D, dtype=torch.float32, device=q.device)  # (T, H, Dv)

    def heads(conv_out: torch.Tensor):
        n = conv_out.shape[0]
        return [part.reshape(n, H, D) for part in torch.split(conv_out, layer.qkv_dim, dim=-1)]

    if batch.decode is not None:
        grp = batch.decode
        conv_out = causal_conv1d_update(mixed[grp.tokens], conv_states, weight, None, grp.state_indices,
                                        layer.activation)  # (B, conv_dim)
        qh, kh, vh = heads(conv_out)
        out[grp.tokens] = kda_update(rec_states, qh, kh, vh, g[grp.tokens], beta[grp.tokens], grp.state_indices,
                                     use_qk_l2norm=True)
    if batch.prefill is not None:
        grp = batch.prefill
        idx = grp.state_indices
        conv_out, conv_final = causal_conv1d_varlen(mixed[grp.tokens], weight, None, grp.cu_seqlens_q,
                                                    read_slots(conv_states, idx), layer.activation)
        write_slots(conv_states, idx, conv_final)
        qh, kh, vh = heads(conv_out)
        out_p, rec_final = kda_varlen(qh, kh, vh, g[grp.tokens], beta[grp.tokens], grp.cu_seqlens_q,
                                      read_slots(rec_states, idx), use_qk_l2norm=True, chunk_size=layer.chunk_size)
        write_slots(rec_states, idx, rec_final)
        out[grp.tokens] = out_p
    y = layer.o_norm(out.to(dtype).reshape(t * H, D), gate.reshape(t * H, D))  # (T H, D)
    return y.reshape(t, H * D)


def _kernel_params(layer: KdaWeights) -> tuple:
    """The float32 parameters the kernels take: the conv weight of q, k and v apart, tap-major (K, H D) each;
    A_log (H,); dt_bias (H D,); the norm weight (D,)."""
    fg, conv = layer.forget_gate, layer.conv1d

    def build() -> tuple:
        n = layer.qkv_dim
        convs = tuple(recurrent_kernels.tap_major(conv.weight[i * n:(i + 1) * n]) for i in range(3))
        return (convs, fg.A_log.detach().float().reshape(-1).contiguous(), fg.dt_bias.detach().float().contiguous(),
                layer.o_norm.weight.detach().float().contiguous())

    return prepared(layer, "_kda_kernel_params", (conv.weight, fg.A_log, fg.dt_bias, layer.o_norm.weight), build)


def _kernel_body(layer: KdaWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                 b: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                 rec_states: StateView, dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU-kernel body: the conv of q, k and v (each over its own channels of the conv state), the KDA
    recurrence (over an 8-bit state: ``kernels/recurrent_coded.py``) with the sigmoid-gated norm per group into
    (T, H D) in ``dtype``; None when declined before any state changed."""
    convs, A_log, dt_bias, norm_w = _kernel_params(layer)
    n = layer.qkv_dim
    conv_parts = [recurrent_kernels.conv_state_channels(conv_states, i * n, (i + 1) * n)
                  for i in range(3)]  # (slots, H D, K-1) each
    if not all(recurrent_kernels.conv_supported(st, w, None, dtype, layer.activation)
               for st, w in zip(conv_parts, convs)):
        return None
    coded = isinstance(rec_states, CodedState)
    shape = (layer.num_heads, layer.head_dim, layer.head_dim)
    if coded and not all(recurrent_coded.group_ok(rec_states, shape, dtype, g.rounding_keys, g.seq_lens,
                                                  g.state_indices) for g in batch.groups):
        return None
    out = torch.empty(q.shape[0], n, dtype=dtype)  # (T, H D)
    for i, g in enumerate(batch.groups):
        qc, kc, vc = (recurrent_kernels.causal_conv1d(p[g.tokens], st, w, None, g.cu_seqlens_q, g.state_indices,
                                                      layer.activation)
                      for p, st, w in zip((q, k, v), conv_parts, convs))
        if i == 0 and qc is None:
            return None
        if qc is None or kc is None or vc is None:
            raise RuntimeError("a Kimi delta attention kernel declined after another ran")
        if not (recurrent_coded.kda(rec_states, qc, kc, vc, f[g.tokens], b[g.tokens], A_log, dt_bias, True,
                                    g.cu_seqlens_q, g.state_indices, g.rounding_keys, g.seq_lens, out[g.tokens],
                                    gate[g.tokens], norm_w, layer.o_norm.eps) if coded
                else recurrent_kernels.kda(rec_states, qc, kc, vc, f[g.tokens], b[g.tokens], A_log, dt_bias, True,
                                           g.cu_seqlens_q, g.state_indices, out[g.tokens], gate[g.tokens], norm_w,
                                           layer.o_norm.eps)):
            raise RuntimeError("a Kimi delta attention kernel declined after another ran")
    return out
