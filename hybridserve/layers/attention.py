"""Self-attention over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.state_shapes import attention_spec
from hybridserve.ops.attend import paged_attend
from hybridserve.ops.elementwise import head_sigmoid_gate, rotate, sigmoid_mul


class Attention(nn.Module):
    """Multi-head / grouped-query attention with optional RoPE and per-head q/k norms.

    Weights use HF names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; with ``qk_norm_eps`` set,
    ``q_norm`` and ``k_norm`` are per-head RMS norms (over head_dim) applied before RoPE
    (``qk_norm_zero_centered``: weights stored as gamma - 1, as in Qwen3-Next). With ``output_gate``
    (Qwen3-Next), ``q_proj`` yields per head ``[query, gate]`` (2 * head_dim) and the attention
    output is multiplied by ``sigmoid(gate)`` before ``o_proj``. With ``head_gate`` (LFM3), ``g_proj``
    maps the layer input to one gate per head, and each head's output is multiplied by its ``sigmoid``.
    """

    def __init__(self, layer_index: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtypes: CacheDtypes, *, bias: bool = False, o_bias: bool | None = None,
                 scale: float | None = None, sliding_window: int | None = None,
                 qk_norm_eps: float | None = None, qk_norm_zero_centered: bool = False,
                 output_gate: bool = False, head_gate: bool = False) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        self.head_gate = head_gate
        if head_gate:
            self.g_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.k_scale = self.v_scale = 1.0  # fp8 KV-cache scales: the checkpoint's (set by the loader) or 1.0
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered=qk_norm_zero_centered)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered=qk_norm_zero_centered)
        self.spec = attention_spec(layer_index, dtypes, num_kv_heads, head_dim, sliding_window)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        t = x.shape[0]
        if self.output_gate:
            q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # (T, Hq, Dh)
        else:
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, Hq, Dh)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, Dh)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        out = paged_attend(q, k, v, batch, batch.caches[self.layer_index], self.scale, self.sliding_window)
        if self.output_gate:
            out = sigmoid_mul(gate, out)  # (T, Hq, Dh)
        if self.head_gate:
            out = head_sigmoid_gate(self.g_proj(x), out)  # each op rounded to out's dtype
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
