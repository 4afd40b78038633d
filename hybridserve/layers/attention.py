"""Self-attention over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.pool import LayerCache
from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.engine.forward_batch import ForwardBatch
from hybridserve.layers.rotary import apply_rotary
from hybridserve.ops.paged_attention import paged_attention, write_kv_cache


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, cache: LayerCache,
                 scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend each group (decode, prefill) to its context.

    q: (T, Hq, Dh); k, v: (T, Hkv, Dh). Returns (T, Hq, Dh) in q's dtype.
    """
    write_kv_cache(k, v, cache.k, cache.v, batch.slot_mapping, cache.k_scale, cache.v_scale)
    out = torch.empty_like(q)
    for group in batch.groups:
        out[group.tokens] = paged_attention(
            q[group.tokens], cache.k, cache.v, group.block_tables, group.seq_lens, group.cu_seqlens_q,
            scale, cache.k_scale, cache.v_scale, sliding_window)
    return out


class Attention(nn.Module):
    """Multi-head / grouped-query attention with optional RoPE and per-head q/k norms.

    Weights use HF names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``.
    """

    def __init__(self, layer_index: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtypes: CacheDtypes, *, bias: bool = False, o_bias: bool | None = None,
                 scale: float | None = None, sliding_window: int | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.spec = LayerCacheSpec(layer_index, "attention",
                                   attention=dtypes.attention(num_kv_heads, head_dim, sliding_window))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, Hq, Dh)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, Dh)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attend(q, k, v, batch, batch.caches[self.layer_index], self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
