"""xLSTM's mLSTM layer over the pooled matrix-memory state (HF's ``xLSTMLayer``, weight names kept).

x -> q, k, v, output gate o, soft-capped input / forget gate pre-activations i, f (per head) -> the
mLSTM cell (``ops/mlstm.py``) -> multi-head layer norm of h -> ``sigmoid(o) * norm(h)`` -> out_proj.

State per sequence, all temporal (``mamba_ssm_cache_dtype``): ``C`` (H, Dk, Dv) the matrix memory,
``n`` (H, Dk) the normalizer, ``m`` (H,) the max state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.state_shapes import mlstm_spec
from hybridserve.ops.mlstm_mixer import mlstm_mix

WEIGHT_MODES = ("single", "fused")


class MultiHeadLayerNorm(nn.Module):
    """HF's ``xLSTMMultiHeadLayerNorm``: a layer norm (no affine) over each head's Dv values in float32,
    cast back, then ``* weight (+ bias)`` over all H*Dv features in the activation dtype."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads * head_dim)) if bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (T, H, Dv) -> (T, H*Dv) in h's dtype."""
        hf = h.float()
        y = (hf - hf.mean(-1, keepdim=True)) * torch.rsqrt(hf.var(-1, keepdim=True, unbiased=False) + self.eps)
        y = y.to(h.dtype).reshape(h.shape[0], -1) * self.weight
        return y + self.bias if self.bias is not None else y


class MLSTMLayer(nn.Module):
    """HF's ``xLSTMLayer`` (``weight_mode`` single: q, k, v, ogate_preact, igate_preact, fgate_preact;
    fused: qkv_opreact, ifgate_preact), multihead_norm, out_proj."""

    def __init__(self, config: Any, layer_index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        if config.weight_mode not in WEIGHT_MODES:
            raise ValueError(f"weight_mode={config.weight_mode!r} is not supported; allowed: {', '.join(WEIGHT_MODES)}")
        hidden, H, bias = config.hidden_size, config.num_heads, config.use_bias
        # HF's layer truncates (int), the config's qk_dim / v_dim round up to 64: the weights follow the layer
        self.qk_dim, self.v_dim = int(hidden * config.qk_dim_factor), int(hidden * config.v_dim_factor)
        if self.qk_dim % H or self.v_dim % H:
            raise ValueError(f"qk_dim ({self.qk_dim}) and v_dim ({self.v_dim}) must be multiples of "
                             f"num_heads ({H})")
        self.layer_index, self.num_heads, self.weight_mode = layer_index, H, config.weight_mode
        self.dk, self.dv = self.qk_dim // H, self.v_dim // H
        self.gate_soft_cap, self.eps = config.gate_soft_cap, config.eps
        self.chunk_size = config.chunk_size
        if self.weight_mode == "single":
            self.q = nn.Linear(hidden, self.qk_dim, bias=bias)
            self.k = nn.Linear(hidden, self.qk_dim, bias=bias)
            self.v = nn.Linear(hidden, self.v_dim, bias=bias)
            self.ogate_preact = nn.Linear(hidden, self.v_dim, bias=bias)
            self.igate_preact = nn.Linear(hidden, H, bias=True)
            self.fgate_preact = nn.Linear(hidden, H, bias=True)
        else:
            self.qkv_opreact = nn.Linear(hidden, 2 * self.qk_dim + 2 * self.v_dim, bias=bias)
            self.ifgate_preact = nn.Linear(hidden, 2 * H, bias=True)
        self.multihead_norm = MultiHeadLayerNorm(H, self.dv, config.norm_eps, bias)
        self.out_proj = nn.Linear(self.v_dim, hidden, bias=bias)
        self.spec = mlstm_spec(layer_index, dtypes, num_heads=H, qk_head_dim=self.dk, v_head_dim=self.dv)

    def _project(self, x: torch.Tensor):
        """x: (T, hidden) -> q, k (T, qk_dim), v, o (T, v_dim), raw i, f pre-activations (T, H), all
        views of the projections in x's dtype."""
        if self.weight_mode == "single":
            return (self.q(x), self.k(x), self.v(x), self.ogate_preact(x), self.igate_preact(x),
                    self.fgate_preact(x))
        q, k, v, o = torch.split(self.qkv_opreact(x), [self.qk_dim, self.qk_dim, self.v_dim, self.v_dim], dim=-1)
        i, f = torch.split(self.ifgate_preact(x), [self.num_heads, self.num_heads], dim=-1)
        return q, k, v, o, i, f

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        cache = batch.caches[self.layer_index]
        # (slots, H, Dk, Dv), (slots, H, Dk), (slots, H)
        states = (cache.state["C"], cache.state["n"], cache.state["m"])
        q, k, v, o, i, f = self._project(x)
        y = mlstm_mix(self, q, k, v, o, i, f, batch, states, x.dtype)  # (T, H*Dv)
        return self.out_proj(y)
