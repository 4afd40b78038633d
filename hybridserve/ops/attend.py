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
    k_pages, v_pages = cache.k, cache.v  # (num_pages, block_size, Hkv, Dh)
    assert k_pages is not None and v_pages is not None and slot_mapping is not None, "an attention layer's cache"
    call("kv_write",
         lambda: attention_kernels.kv_write(k, v, k_pages, v_pages, slot_mapping, cache.k_scale, cache.v_scale),
         lambda: write_kv_cache(k, v, k_pages, v_pages, slot_mapping, cache.k_scale, cache.v_scale),
         k, k_pages)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, Hq, Dh)
    for group in batch.groups:
        tables = group.window_block_tables if window else group.block_tables
        assert tables is not None, "a group of an attention step has block tables"
        _attend_group(q, (k_pages, v_pages, cache.k_scale, cache.v_scale), tables, group, scale, sliding_window,
                      out)
    return out


def _attend_group(q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor, float, float], tables: torch.Tensor,
                  group: SeqGroup, scale: float, sliding_window: int | None, out: torch.Tensor) -> None:
    """Attend one group's rows of q to their paged context (``pages``: K, V and their scales), into the
    same rows of ``out``."""
    k_pages, v_pages, k_scale, v_scale = pages

    def kernel() -> bool:
        return attention_kernels.paged_attention(
            q[group.tokens], k_pages, v_pages, tables, group.seq_lens, group.cu_seqlens_q, scale,
            k_scale, v_scale, sliding_window, out[group.tokens])

    def plain() -> bool:
        out[group.tokens] = paged_attention(
            q[group.tokens], k_pages, v_pages, tables, group.seq_lens, group.cu_seqlens_q,
            scale, k_scale, v_scale, sliding_window)
        return True

    call("paged_attention", kernel, plain, q, k_pages)
