"""Multi-head latent attention with the up projection absorbed, as one op entry (the math is in
``layers/mla.py``'s docstring): the query moved into latent space by W_uk, paged attention over the cached
latents (K = V = the latent), the values brought back by W_uv.

Pool-in-place contract: :func:`absorbed_latent_attention` writes each token's latent into the layer's pages at
the batch's slot mapping and reads the pages of the batch's block tables (``ops/attend.py: paged_attend``).
Two bodies, chosen in ``ops/dispatch.py``: the CPU kernels (``kernels/pointwise.py: concat_cols``,
``kernels/gemm.py: per_head_linear_f32``, float32 sums rounded to the activation dtype as the einsums' results
are) and plain PyTorch (``torch.cat``, ``torch.einsum``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hybridserve.cache.pool import LayerCache
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.ops.attend import paged_attend
from hybridserve.ops.dispatch import call
from hybridserve.ops.prepared import prepared


class LatentWeights(Protocol):
    """What the op reads of a latent attention layer (``layers/mla.py: LatentAttention``)."""

    layer_index: int
    num_heads: int
    rank: int  # kv_lora_rank
    nope: int
    rope: int
    v_dim: int
    scale: float  # the softmax scale
    kv_b_proj: nn.Linear  # rank -> H (nope + v): W_uk and W_uv per head


def absorbed_latent_attention(layer: LatentWeights, q: torch.Tensor, c_kv: torch.Tensor, k_shared: torch.Tensor,
                              batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
    """q: (T, H, nope + rope); c_kv: (T, rank) the normed latent; k_shared: (T, rope) the key part all heads
    share. Caches ``[c_kv | k_shared]`` and attends over the cached latents. Returns o (T, H, v) in ``dtype``."""
    args = (layer, q, c_kv, k_shared, batch, dtype)
    return call("latent_attention", lambda: _kernel_body(*args), lambda: _plain_body(*args), q,
                layer.kv_b_proj.weight)


def _absorbed(layer: LatentWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """W_uk (H, nope, rank) and W_uv (H, v, rank), float32 views of ``kv_b_proj`` (made once per weight)."""
    w = layer.kv_b_proj.weight

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        wf = w.detach().float().view(layer.num_heads, layer.nope + layer.v_dim, layer.rank)
        return wf[:, :layer.nope].contiguous(), wf[:, layer.nope:].contiguous()

    return prepared(layer, "_mla_absorbed", (w,), build, w.dtype)


def _latent_pages(layer: LatentWeights, batch: ForwardBatch) -> LayerCache:
    """The layer's latent pages as both the K and the V cache of ``paged_attend``."""
    cache = batch.caches[layer.layer_index]
    return LayerCache(k=cache.latent, v=cache.latent, k_scale=cache.k_scale, v_scale=cache.k_scale)


def _plain_body(layer: LatentWeights, q: torch.Tensor, c_kv: torch.Tensor, k_shared: torch.Tensor,
                batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch body."""
    t = q.shape[0]
    latent = torch.cat([c_kv, k_shared], dim=-1).view(t, 1, layer.rank + layer.rope)
    w_uk, w_uv = _absorbed(layer)
    q_lat = torch.einsum("thn,hnr->thr", q[..., :layer.nope].float(), w_uk)  # (T, H, rank)
    q_full = torch.cat([q_lat.to(dtype), q[..., layer.nope:]], dim=-1)  # (T, H, rank + rope)
    out = paged_attend(q_full, latent, latent, batch, _latent_pages(layer, batch), layer.scale)
    o = torch.einsum("thr,hvr->thv", out[..., :layer.rank].float(), w_uv)  # (T, H, v)
    return o.to(dtype)


def _kernel_body(layer: LatentWeights, q: torch.Tensor, c_kv: torch.Tensor, k_shared: torch.Tensor,
                 batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU-kernel body: the latent's concatenation and both absorbed up projections on kernels; None when
    declined before the cache changed."""
    t, H, qk = q.shape[0], layer.num_heads, layer.nope + layer.rope
    w = layer.kv_b_proj.weight
    _, w_uv = _absorbed(layer)
    w_uk_t = prepared(layer, "_mla_w_uk_t", (w,), lambda: _absorbed(layer)[0].transpose(1, 2).contiguous(),
                      w.dtype)  # (H, rank, nope)
    latent = pointwise_kernels.concat_cols(c_kv, k_shared)
    q_lat = torch.empty(t, H, layer.rank, dtype=dtype)  # (T, H, rank)
    if latent is None or not gemm.per_head_linear_f32(q[..., :layer.nope], w_uk_t, q_lat):
        return None
    q_full = pointwise_kernels.concat_cols(q_lat.view(t * H, layer.rank),
                                           q.view(t * H, qk)[:, layer.nope:])  # (T H, rank + rope)
    if q_full is None:
        return None
    latent = latent.view(t, 1, layer.rank + layer.rope)
    out = paged_attend(q_full.view(t, H, layer.rank + layer.rope), latent, latent, batch,
                       _latent_pages(layer, batch), layer.scale)  # (T, H, rank + rope)
    o = torch.empty(t, H, layer.v_dim, dtype=dtype)  # (T, H, v)
    if not gemm.per_head_linear_f32(out[..., :layer.rank], w_uv, o):
        raise RuntimeError("the absorbed value projection declined after attention ran")
    return o
