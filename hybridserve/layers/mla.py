"""Multi-head latent attention (MLA, DeepSeek-V2 style) over a paged cache of compressed latents.

Each token caches one latent ``c = [kv_a_layernorm(c_kv) (kv_lora_rank) | k_shared (rope_dim)]``
(``LatentAttentionSpec``), in the same 16-token pages as K/V, so prefix caching, forks and preemption
treat it like any KV page. Attention runs on the latent with the up projection absorbed:
``kv_b_proj`` holds per head W_uk (nope, rank) and W_uv (v, rank), and

    q_h . k_h  = (W_uk^T q_nope_h) . c_kv + q_shared_h . k_shared      (the query moved into latent space)
    o_h        = W_uv (sum_j p_hj c_kv_j)                              (values summed in latent space)

so every step is multi-query attention with one head of ``rank + rope_dim`` whose keys and values are
both the cached latent (``paged_attend`` with K = V = the latent pages; the value's last ``rope_dim``
outputs are dropped). Decode then reads rank + rope_dim values per cached token and never expands K/V
for the whole context each step, and the existing paged-attention op and CPU kernel serve it unchanged.

Kimi Linear applies no rotary embedding here (HF's ``KimiLinearAttention``: NoPE); ``k_shared`` is the
key part all heads share.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.pool import LayerCache
from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.state_shapes import mla_spec
from hybridserve.ops.attend import paged_attend
from hybridserve.ops.dispatch import call


class LatentAttention(nn.Module):
    """HF names: ``q_proj`` (or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` with ``q_lora_rank``),
    ``kv_a_proj_with_mqa`` (hidden -> rank + rope_dim), ``kv_a_layernorm``, ``kv_b_proj`` (rank -> heads
    * (nope + v)), ``o_proj``. Softmax scale ``(nope + rope_dim) ** -0.5``."""

    def __init__(self, layer_index: int, hidden_size: int, *, num_heads: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, dtypes: CacheDtypes,
                 q_lora_rank: int | None = None, bias: bool = False, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.layer_index, self.num_heads = layer_index, num_heads
        self.rank, self.nope, self.rope, self.v_dim = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora = q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.kv_b_proj.prepack = False  # its weight is read as W_uk / W_uv, never applied as a linear
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.scale = qk_dim ** -0.5
        self.k_scale = self.v_scale = 1.0  # fp8 cache scale of the latent (the loader may set k_scale)
        self.spec = mla_spec(layer_index, dtypes, kv_lora_rank, qk_rope_head_dim)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk (H, nope, rank) and W_uv (H, v, rank), float32 views of ``kv_b_proj`` (made once per weight)."""
        w = self.kv_b_proj.weight
        if getattr(self, "_absorbed_key", None) != (w.data_ptr(), w.dtype):
            wf = w.detach().float().view(self.num_heads, self.nope + self.v_dim, self.rank)
            self._absorbed_w = (wf[:, :self.nope].contiguous(), wf[:, self.nope:].contiguous())
            self._absorbed_key = (w.data_ptr(), w.dtype)
        return self._absorbed_w

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        return call("latent_attention", lambda: self._forward_kernels(x, batch),
                    lambda: self._forward_plain(x, batch), x, self.kv_b_proj.weight)

    def _forward_plain(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The PyTorch body."""
        t, H = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, H, self.nope + self.rope)  # (T, H, nope + rope)
        c_kv, k_shared = torch.split(self.kv_a_proj_with_mqa(x), [self.rank, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_shared], dim=-1).view(t, 1, self.rank + self.rope)
        w_uk, w_uv = self._absorbed()
        q_lat = torch.einsum("thn,hnr->thr", q[..., :self.nope].float(), w_uk)  # (T, H, rank)
        q_full = torch.cat([q_lat.to(x.dtype), q[..., self.nope:]], dim=-1)  # (T, H, rank + rope)
        cache = batch.caches[self.layer_index]
        pages = LayerCache(k=cache.latent, v=cache.latent, k_scale=cache.k_scale, v_scale=cache.k_scale)
        out = paged_attend(q_full, latent, latent, batch, pages, self.scale)
        o = torch.einsum("thr,hvr->thv", out[..., :self.rank].float(), w_uv)  # (T, H, v)
        return self.o_proj(o.to(x.dtype).reshape(t, H * self.v_dim))

    def _forward_kernels(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """The CPU-kernel path: the same steps, the latent's concatenation and both absorbed up
        projections on kernels (``gemm.per_head_linear_f32``: float32 sums rounded to x's dtype, as the
        einsums' results are); None when declined before the cache changed."""
        t, H, qk = x.shape[0], self.num_heads, self.nope + self.rope
        _, w_uv = self._absorbed()
        if getattr(self, "_w_uk_t_key", None) != self._absorbed_key:  # W_uk per head as (rank, nope)
            self._w_uk_t = self._absorbed()[0].transpose(1, 2).contiguous()  # (H, rank, nope)
            self._w_uk_t_key = self._absorbed_key
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, H, qk)  # (T, H, nope + rope)
        kv = self.kv_a_proj_with_mqa(x)  # (T, rank + rope)
        latent = pointwise_kernels.concat_cols(self.kv_a_layernorm(kv[:, :self.rank]), kv[:, self.rank:])
        q_lat = torch.empty(t, H, self.rank, dtype=x.dtype)  # (T, H, rank)
        if latent is None or not gemm.per_head_linear_f32(q[..., :self.nope], self._w_uk_t, q_lat):
            return None
        q_full = pointwise_kernels.concat_cols(q_lat.view(t * H, self.rank),
                                               q.view(t * H, qk)[:, self.nope:])  # (T H, rank + rope)
        if q_full is None:
            return None
        latent = latent.view(t, 1, self.rank + self.rope)
        cache = batch.caches[self.layer_index]
        pages = LayerCache(k=cache.latent, v=cache.latent, k_scale=cache.k_scale, v_scale=cache.k_scale)
        out = paged_attend(q_full.view(t, H, self.rank + self.rope), latent, latent, batch, pages,
                           self.scale)  # (T, H, rank + rope)
        o = torch.empty(t, H, self.v_dim, dtype=x.dtype)  # (T, H, v)
        if not gemm.per_head_linear_f32(out[..., :self.rank], w_uv, o):
            raise RuntimeError("the absorbed value projection declined after attention ran")
        return self.o_proj(o.view(t, H * self.v_dim))
