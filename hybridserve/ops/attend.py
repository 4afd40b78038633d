"""Paged attention as one op entry: store this step's K/V in the layer's pages, then attend each group of
the batch (decode, prefill) to its context, on the compiled CPU kernels or in plain PyTorch
(``ops/dispatch.py``)."""

from __future__ import annotations

import torch

from hybridserve.cache.pool import LayerCache
from hybridserve.forward_batch import ForwardBatch, SeqGroup
from hybridserve.kernels import attention as attention_kernels
from hybridserve.ops.dispatch import call
from hybridserve.ops.paged_attention import paged_attention, write_kv_cache


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, cache: LayerCache,
                 scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend each group (decode, prefill) to its context.

    q: (T, Hq, Dh); k, v: (T, Hkv, Dh). Returns (T, Hq, Dh) in q's dtype. A layer of the window page
    group (``cache.window_group``) reads and writes its pages through the window tables; their entries
    behind the window are released (-1 in the sequence, any page here) and never read.
    """
    window = cache.window_group
    slot_mapping = batch.window_slot_mapping if window else batch.slot_mapping
    call("kv_write",
         lambda: attention_kernels.kv_write(k, v, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale),
         lambda: write_kv_cache(k, v, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale),
         k, cache.k)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, Hq, Dh)
    for group in batch.groups:
        tables = group.window_block_tables if window else group.block_tables
        _attend_group(q, cache, tables, group, scale, sliding_window, out)
    return out


def _attend_group(q: torch.Tensor, cache: LayerCache, tables: torch.Tensor, group: SeqGroup, scale: float,
                  sliding_window: int | None, out: torch.Tensor) -> None:
    """Attend one group's rows of q to their paged context, into the same rows of ``out``."""
    def kernel() -> bool:
        return attention_kernels.paged_attention(
            q[group.tokens], cache.k, cache.v, tables, group.seq_lens, group.cu_seqlens_q, scale,
            cache.k_scale, cache.v_scale, sliding_window, out[group.tokens])

    def plain() -> bool:
        out[group.tokens] = paged_attention(
            q[group.tokens], cache.k, cache.v, tables, group.seq_lens, group.cu_seqlens_q,
            scale, cache.k_scale, cache.v_scale, sliding_window)
        return True

    call("paged_attention", kernel, plain, q, cache.k)
