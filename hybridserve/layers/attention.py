"""Self-attention over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.pool import LayerCache
from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import attention as attention_kernels
from hybridserve.kernels import fallbacks
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import apply_rotary
from hybridserve.layers.state_shapes import attention_spec
from hybridserve.ops.paged_attention import paged_attention, write_kv_cache


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], use_cpu_kernels: bool) -> torch.Tensor:
    """RoPE on x (T, H, Dh) with (cos, sin): in place by the CPU kernel where it covers the call, else
    ``apply_rotary`` (a new tensor)."""
    t, heads, dh = x.shape
    if use_cpu_kernels:
        if x.is_contiguous() and pointwise_kernels.rotary(x.view(t, heads * dh), heads, dh, *rope):
            return x
        fallbacks.record("rotary", fallbacks.describe(x, rope[0]))
    return apply_rotary(x, *rope)


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, cache: LayerCache,
                 scale: float, sliding_window: int | None = None, use_cpu_kernels: bool = False) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend each group (decode, prefill) to its context.

    q: (T, Hq, Dh); k, v: (T, Hkv, Dh). Returns (T, Hq, Dh) in q's dtype. ``use_cpu_kernels``: use the
    compiled CPU kernels where they cover the call. A layer of the window page group
    (``cache.window_group``) reads and writes its pages through the window tables; their entries behind
    the window are released (-1 in the sequence, any page here) and never read.
    """
    window = cache.window_group
    slot_mapping = batch.window_slot_mapping if window else batch.slot_mapping
    if not (use_cpu_kernels and attention_kernels.kv_write(k, v, cache.k, cache.v, slot_mapping,
                                                            cache.k_scale, cache.v_scale)):
        if use_cpu_kernels:
            fallbacks.record("kv_write", fallbacks.describe(k, cache.k))
        write_kv_cache(k, v, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, Hq, Dh)
    for group in batch.groups:
        tables = group.window_block_tables if window else group.block_tables
        if use_cpu_kernels and attention_kernels.paged_attention(
                q[group.tokens], cache.k, cache.v, tables, group.seq_lens, group.cu_seqlens_q, scale,
                cache.k_scale, cache.v_scale, sliding_window, out[group.tokens]):
            continue
        if use_cpu_kernels:
            fallbacks.record("paged_attention", fallbacks.describe(q, cache.k))
        out[group.tokens] = paged_attention(
            q[group.tokens], cache.k, cache.v, tables, group.seq_lens, group.cu_seqlens_q,
            scale, cache.k_scale, cache.v_scale, sliding_window)
    return out


class Attention(nn.Module):
    """Multi-head / grouped-query attention with optional RoPE and per-head q/k norms.

    Weights use HF names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; with ``qk_norm_eps`` set,
    ``q_norm`` and ``k_norm`` are per-head RMS norms (over head_dim) applied before RoPE
    (``qk_norm_zero_centered``: weights stored as gamma - 1, as in Qwen3-Next). With ``output_gate``
    (Qwen3-Next), ``q_proj`` yields per head ``[query, gate]`` (2 * head_dim) and the attention
    output is multiplied by ``sigmoid(gate)`` before ``o_proj``. With ``head_gate`` (LFM3), ``g_proj``
    maps the layer input to one gate per head, and each head's output is multiplied by its ``sigmoid``.
    """

    use_cpu_kernels = False  # set by the engine when the compiled CPU kernels are on and available

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
            q, k = rotate(q, rope, self.use_cpu_kernels), rotate(k, rope, self.use_cpu_kernels)
        out = paged_attend(q, k, v, batch, batch.caches[self.layer_index], self.scale, self.sliding_window,
                           self.use_cpu_kernels)
        if self.output_gate:
            gated = pointwise_kernels.sigmoid_mul(gate, out) if self.use_cpu_kernels else None
            if gated is None:
                if self.use_cpu_kernels:
                    fallbacks.record("sigmoid_mul", fallbacks.describe(gate, out))
                gated = out * torch.sigmoid(gate)  # (T, Hq, Dh)
            out = gated
        if self.head_gate:
            out = self._gate_heads(self.g_proj(x), out)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _gate_heads(self, gate: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """gate (T, Hq), out (T, Hq, Dh) -> ``out * sigmoid(gate)`` per head, each op rounded to out's dtype."""
        t = out.shape[0]
        if self.use_cpu_kernels:
            gated = pointwise_kernels.row_sigmoid_gate(gate.reshape(t * self.num_heads, 1),
                                                       out.reshape(t * self.num_heads, self.head_dim))
            if gated is not None:
                return gated.view(t, self.num_heads, self.head_dim)
            fallbacks.record("row_sigmoid_gate", fallbacks.describe(gate, out))
        return out * torch.sigmoid(gate)[..., None]  # (T, Hq, Dh)
