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

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.state_shapes import mla_spec
from hybridserve.ops.latent_attention import absorbed_latent_attention


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

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        t, H = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, H, self.nope + self.rope)  # (T, H, nope + rope)
        kv = self.kv_a_proj_with_mqa(x)  # (T, rank + rope)
        c_kv, k_shared = self.kv_a_layernorm(kv[:, :self.rank]), kv[:, self.rank:]
        o = absorbed_latent_attention(self, q, c_kv, k_shared, batch, x.dtype)  # (T, H, v)
        return self.o_proj(o.reshape(t, H * self.v_dim))
