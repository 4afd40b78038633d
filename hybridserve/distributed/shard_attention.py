"""Sharding the attention layers: softmax attention (GQA, KV heads replicated when fewer than ranks), MLA and
MiniMax's lightning attention."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybridserve.distributed.layers import HeadSliceLightningAttention
from hybridserve.distributed.sharder import Sharder, even
from hybridserve.layers.attention import Attention


def attention(sh: Sharder, prefix: str, m: Attention) -> None:
    heads = even("num_attention_heads", m.num_heads, sh.world)
    kv = m.num_kv_heads
    if kv % sh.world == 0:
        kv_local, kv_start = kv // sh.world, sh.rank * (kv // sh.world)
    elif sh.world % kv == 0:  # fewer KV heads than ranks: each rank keeps (a copy of) the one its heads use
        kv_local, kv_start = 1, sh.rank // (sh.world // kv)
    else:
        raise ValueError(f"num_key_value_heads={kv} neither divides nor is divisible by "
                         f"tensor_parallel_size={sh.world} (num_attention_heads={m.num_heads})")
    dh = m.head_dim
    per_head = dh * (2 if getattr(m, "output_gate", False) else 1)
    q_rows, kv_rows = [(sh.rank * heads * per_head, heads * per_head)], [(kv_start * dh, kv_local * dh)]
    sh.column(f"{prefix}q_proj.", m.q_proj, q_rows)
    sh.column(f"{prefix}k_proj.", m.k_proj, kv_rows)
    sh.column(f"{prefix}v_proj.", m.v_proj, kv_rows)
    if getattr(m, "head_gate", False):
        sh.column(f"{prefix}g_proj.", m.g_proj, [(sh.rank * heads, heads)])
    if getattr(m, "use_adapter", False):  # Zamba2's per-use low-rank adapters, added to q, k and v
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            sh.adapters(f"{prefix}linear_{name}_adapter_list.", getattr(m, f"linear_{name}_adapter_list"), rows)
    sh.row(f"{prefix}o_proj.", m.o_proj, (sh.rank * heads * dh, heads * dh))
    m.num_heads, m.num_kv_heads = heads, kv_local
    m.spec = dataclasses.replace(m.spec, attention=dataclasses.replace(m.spec.attention, num_kv_heads=kv_local))
    sh.reduce_output(m)


def whole_projection_norm_attention(sh: Sharder, prefix: str, m: Attention) -> None:
    """OLMo-3's attention: q/k norms over all heads' projections, spanning the ranks."""
    kv, world = m.num_kv_heads, sh.world
    if kv % world:
        raise ValueError(f"num_key_value_heads={kv} is not divisible by tensor_parallel_size={world} (its k "
                         "norm spans every KV head)")
    q_rows = [(sh.rank * (m.num_heads // world) * m.head_dim, m.num_heads // world * m.head_dim)]
    kv_rows = [(sh.rank * (kv // world) * m.head_dim, kv // world * m.head_dim)]
    attention(sh, prefix, m)
    sh.spanning_norm(f"{prefix}q_norm.", m.q_norm, q_rows)
    sh.spanning_norm(f"{prefix}k_norm.", m.k_norm, kv_rows)


def latent_attention(sh: Sharder, prefix: str, m: nn.Module) -> None:
    """MLA: query heads split; the latent (one per token, shared by every head) is whole on every rank."""
    heads = even("num_attention_heads", m.num_heads, sh.world)
    start, qk, kv = sh.rank * heads, m.nope + m.rope, m.nope + m.v_dim
    q = m.q_b_proj if m.q_lora else m.q_proj
    sh.column(f"{prefix}{'q_b_proj' if m.q_lora else 'q_proj'}.", q, [(start * qk, heads * qk)])
    sh.column(f"{prefix}kv_b_proj.", m.kv_b_proj, [(start * kv, heads * kv)])
    sh.row(f"{prefix}o_proj.", m.o_proj, (start * m.v_dim, heads * m.v_dim))
    m.num_heads = heads
    sh.reduce_output(m)


def lightning_attention(sh: Sharder, prefix: str, m: nn.Module) -> None:
    """MiniMax's linear attention: heads split (``qkv_proj`` per head ``[q | k | v]``), the norm over all
    heads spanning ranks, each head keeping its own decay rate."""
    heads = even("num_attention_heads", m.num_heads, sh.world)
    start, D = sh.rank * heads, m.head_dim
    sh.column(f"{prefix}qkv_proj.", m.qkv_proj, [(start * 3 * D, heads * 3 * D)])
    sh.column(f"{prefix}output_gate.", m.output_gate, [(start * D, heads * D)])
    sh.spanning_norm(f"{prefix}norm.", m.norm, [(start * D, heads * D)])
    sh.row(f"{prefix}out_proj.", m.out_proj, (start * D, heads * D))
    m.slope_rate = torch.empty(heads, device=m.slope_rate.device)
    m.__class__ = HeadSliceLightningAttention
    m.total_heads, m.head_start, m.num_heads = m.num_heads, start, heads
    m.spec = sh.state_slices(m.spec, {"kv_state": (heads, D, D)})
    sh.reduce_output(m)
