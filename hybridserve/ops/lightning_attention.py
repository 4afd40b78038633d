"""MiniMax's lightning (decayed linear) attention as one op entry: the activation of the q/k/v projection,
the decayed recurrence, the RMS norm and the sigmoid output gate.

Pool-in-place contract: :func:`lightning_attention_mix` reads each sequence group's KV state at its slots
(``state_indices``) of the pool view and writes the new state there in place. Two bodies, chosen in
``ops/dispatch.py``: the CPU kernels (``kernels/pointwise.py``: silu, sigmoid gate; ``kernels/recurrent.py:
linear_attention``) and plain PyTorch (``ops/linear_attention.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.state_codec import CodedState, StateView
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.kernels import recurrent_coded
from hybridserve.ops.coded_plain import float_states_of_batch
from hybridserve.ops.dispatch import call
from hybridserve.ops.linear_attention import linear_attention_update, linear_attention_varlen


class LightningWeights(Protocol):
    """What the op reads of a lightning attention layer (``models/minimax.py: LightningAttention``)."""

    num_heads: int
    head_dim: int
    block_size: int
    act: str  # the activation's name ("silu" runs on the kernels)
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    slope_rate: torch.Tensor  # (H,) float32 decay rates
    norm: Callable[[torch.Tensor], torch.Tensor]  # RMS norm over H D


def lightning_attention_mix(layer: LightningWeights, qkv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                            states: StateView, dtype: torch.dtype) -> torch.Tensor:
    """``sigmoid(gate) * norm(linear_attention(act(qkv)))`` over the batch's state slots in place.

    qkv: (T, H 3D) the raw projection, per head ``[q | k | v]``; gate: (T, H D) the raw output-gate projection;
    states: (slots, H, D, D) pool view. Returns (T, H D) in ``dtype``.
    """
    args = (layer, qkv, gate, batch, states, dtype)
    return call("linear_attention", lambda: _kernel_body(*args), lambda: _plain(*args), qkv, states)


def _plain(layer: LightningWeights, qkv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
           states: StateView, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body on float views of the state (an 8-bit one decoded for the call: ops/coded_plain.py)."""
    if not isinstance(states, CodedState):  # float states: read and written in place
        return _plain_body(layer, qkv, gate, batch, states, dtype)
    with float_states_of_batch(batch, (states,)) as (local_batch, (local,)):
        return _plain_body(layer, qkv, gate, local_batch, local, dtype)


def _plain_body(layer: LightningWeights, qkv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body (``ops/linear_attention.py``)."""
    t, H, D = qkv.shape[0], layer.num_heads, layer.head_dim
    q, k, v = torch.split(layer.act_fn(qkv).view(t, H, 3 * D), D, dim=-1)  # (T, H, D) each
    y = torch.empty(t, H, D, dtype=torch.float32, device=qkv.device)  # (T, H, D)
    if batch.decode is not None:
        g = batch.decode
        y[g.tokens] = linear_attention_update(states, q[g.tokens], k[g.tokens], v[g.tokens], layer.slope_rate,
                                              g.state_indices)
    if batch.prefill is not None:
        g = batch.prefill
        idx = g.state_indices
        y_p, final = linear_attention_varlen(q[g.tokens], k[g.tokens], v[g.tokens], layer.slope_rate,
                                             g.cu_seqlens_q, read_slots(states, idx), chunk_size=layer.block_size)
        write_slots(states, idx, final)
        y[g.tokens] = y_p
    y = layer.norm(y.reshape(t, H * D).to(dtype))  # (T, H*D)
    return torch.sigmoid(gate) * y


def _kernel_body(layer: LightningWeights, qkv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                 states: StateView, dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU-kernel body: silu(qkv), the decayed recurrence per group (over an 8-bit state:
    ``kernels/recurrent_coded.py``) into y in ``dtype``, the norm, the sigmoid gate; None when declined before
    any state changed."""
    if layer.act != "silu":
        return None
    qkv = pointwise_kernels.silu(qkv)  # (T, H * 3D), per head [q | k | v]
    if qkv is None:
        return None
    y = torch.empty(qkv.shape[0], layer.num_heads * layer.head_dim, dtype=dtype)  # (T, H*D)
    for i, g in enumerate(batch.groups):
        H, D = layer.num_heads, layer.head_dim
        if not (recurrent_coded.linear_attention(states, qkv[g.tokens], H, D, layer.slope_rate, g.cu_seqlens_q,
                                                 g.state_indices, g.rounding_keys, g.seq_lens, y[g.tokens])
                if isinstance(states, CodedState)
                else recurrent_kernels.linear_attention(states, qkv[g.tokens], H, D, layer.slope_rate,
                                                        g.cu_seqlens_q, g.state_indices, y[g.tokens])):
            if i == 0:
                return None
            raise RuntimeError("the linear attention kernel declined a group after another ran")
    gated = pointwise_kernels.sigmoid_mul(gate, layer.norm(y))
    if gated is None:
        raise RuntimeError("the sigmoid gate kernel declined after the recurrence ran")
    return gated
