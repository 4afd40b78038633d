"""xLSTM's mLSTM cell with its multi-head norm and output gate as one op entry.

Pool-in-place contract: :func:`mlstm_mix` reads each sequence group's matrix memory C, normalizer n and max
state m at its slots (``state_indices``) of the pool views and writes their new values there in place. Two
bodies, chosen in ``ops/dispatch.py``: the CPU kernel (``kernels/recurrent.py: mlstm``, soft caps, cell, norm
and gate in one call per group) and plain PyTorch (``ops/mlstm.py`` and the layer's norm module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.state_codec import CodedState, StateView
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.kernels import recurrent_coded
from hybridserve.ops.coded_plain import any_coded, float_states_of_batch
from hybridserve.ops.dispatch import call
from hybridserve.ops.mlstm import fit_max_state, mlstm_update, mlstm_varlen, soft_cap


class HeadNorm(Protocol):
    """``layers/mlstm.py: MultiHeadLayerNorm``: (T, H, Dv) -> (T, H Dv)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    __call__: Callable[[torch.Tensor], torch.Tensor]


class MlstmWeights(Protocol):
    """What the op reads of an mLSTM layer."""

    num_heads: int
    dk: int
    dv: int
    v_dim: int
    gate_soft_cap: float | None
    eps: float
    chunk_size: int
    multihead_norm: HeadNorm


def mlstm_mix(layer: MlstmWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              i: torch.Tensor, f: torch.Tensor, batch: ForwardBatch, states: tuple[StateView, ...],
              dtype: torch.dtype) -> torch.Tensor:
    """``sigmoid(o) * norm(mlstm(q, k, v, i, f))`` over the batch's state slots in place.

    q, k: (T, H Dk); v, o: (T, H Dv); i, f: (T, H) raw gate pre-activations (soft-capped here); states: the pool
    views C (slots, H, Dk, Dv), n (slots, H, Dk), m (slots, H). Returns (T, H Dv) in ``dtype``.
    """
    args = (layer, q, k, v, o, i, f, batch, states, dtype)
    return call("mlstm", lambda: _kernel_body(*args), lambda: _plain(*args), q, states[0])


def _plain(layer: MlstmWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
           i: torch.Tensor, f: torch.Tensor, batch: ForwardBatch, states: tuple[StateView, ...],
           dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body on float views of the states (8-bit ones decoded for the call: ops/coded_plain.py)."""
    if not any_coded(*states):  # float states: read and written in place
        return _plain_body(layer, q, k, v, o, i, f, batch, cast(tuple[torch.Tensor, ...], states), dtype)
    with float_states_of_batch(batch, states) as (local_batch, local):
        return _plain_body(layer, q, k, v, o, i, f, local_batch, local, dtype)


def _plain_body(layer: MlstmWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                i: torch.Tensor, f: torch.Tensor, batch: ForwardBatch, states: tuple[torch.Tensor, ...],
                dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body."""
    t, H, Dk, Dv = q.shape[0], layer.num_heads, layer.dk, layer.dv
    q, k, v = q.reshape(t, H, Dk), k.reshape(t, H, Dk), v.reshape(t, H, Dv)
    i = soft_cap(i, layer.gate_soft_cap).float()  # (T, H), capped in the activation dtype as HF does
    f = soft_cap(f, layer.gate_soft_cap).float()
    h = torch.empty(t, H, Dv, dtype=torch.float32, device=q.device)  # (T, H, Dv)
    if batch.decode is not None:
        g = batch.decode
        h[g.tokens] = mlstm_update(states, q[g.tokens], k[g.tokens], v[g.tokens], i[g.tokens], f[g.tokens],
                                   g.state_indices, eps=layer.eps)
    if batch.prefill is not None:
        g = batch.prefill
        idx = g.state_indices
        h_p, final = mlstm_varlen(q[g.tokens], k[g.tokens], v[g.tokens], i[g.tokens], f[g.tokens],
                                  g.cu_seqlens_q, tuple(read_slots(s, idx) for s in states), eps=layer.eps,
                                  chunk_size=layer.chunk_size)
        for s, value in zip(states, fit_max_state(*final, states[2].dtype)):
            write_slots(s, idx, value)
        h[g.tokens] = h_p
    return torch.sigmoid(o) * layer.multihead_norm(h.to(dtype))  # (T, H*Dv)


def _kernel_body(layer: MlstmWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 i: torch.Tensor, f: torch.Tensor, batch: ForwardBatch, states: tuple[StateView, ...],
                 dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU-kernel body: one kernel call per group into (T, H Dv) (C and n 8-bit, m a float view:
    ``kernels/recurrent_coded.py``); None when declined before any state changed."""
    y = torch.empty(q.shape[0], layer.v_dim, dtype=q.dtype)  # (T, H*Dv)
    norm = layer.multihead_norm
    coded = isinstance(states[0], CodedState)
    for n, g in enumerate(batch.groups):
        args = (q[g.tokens], k[g.tokens], v[g.tokens], o[g.tokens], i[g.tokens], f[g.tokens], layer.gate_soft_cap,
                norm.weight, norm.bias, norm.eps, layer.eps, g.cu_seqlens_q, g.state_indices)
        if not (recurrent_coded.mlstm(states, *args, g.rounding_keys, g.seq_lens, y[g.tokens]) if coded
                else recurrent_kernels.mlstm(states, *args, y[g.tokens])):
            if n == 0:
                return None
            raise RuntimeError("the mLSTM kernel declined a group after another ran")
    return y
