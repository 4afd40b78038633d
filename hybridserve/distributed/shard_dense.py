"""Sharding the dense blocks: MLPs, MoE experts, the vocabulary-parallel embedding and LM head."""

from __future__ import annotations

from torch import nn

from hybridserve.distributed.layers import VocabParallelEmbedding
from hybridserve.distributed.sharder import Sharder, even, slicer
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mlp import GatedMLP, PlainMLP
from hybridserve.layers.moe import FusedExperts


def gated_mlp(sh: Sharder, prefix: str, m: GatedMLP) -> None:
    inter = m.gate_proj.out_features
    even("intermediate_size", inter, sh.world)
    share = sh.share(inter)
    sh.column(f"{prefix}gate_proj.", m.gate_proj, [share])
    sh.column(f"{prefix}up_proj.", m.up_proj, [share])
    sh.row(f"{prefix}down_proj.", m.down_proj, share)
    sh.reduce_output(m)


def plain_mlp(sh: Sharder, prefix: str, m: PlainMLP) -> None:
    inter = m.up_proj.out_features
    even("intermediate_size", inter, sh.world)
    share = sh.share(inter)
    sh.column(f"{prefix}up_proj.", m.up_proj, [share])
    sh.row(f"{prefix}down_proj.", m.down_proj, share)
    sh.reduce_output(m)


def fused_gate_up_mlp(sh: Sharder, prefix: str, m: nn.Module, up: str, down: str) -> None:
    """An MLP whose ``up`` projection yields ``[gate | up]`` (Granite-4.0-H's shared MLP)."""
    up_linear, down_linear = getattr(m, up), getattr(m, down)
    inter = even("shared_intermediate_size", up_linear.out_features // 2, sh.world) * sh.world
    start, size = sh.share(inter)
    sh.column(f"{prefix}{up}.", up_linear, [(start, size), (inter + start, size)])
    sh.row(f"{prefix}{down}.", down_linear, (start, size))
    sh.reduce_output(m)


def zamba2_mlp(sh: Sharder, prefix: str, m: nn.Module) -> None:
    """Zamba2's MLP: ``gate_up_proj`` (and its adapters) yields ``[gate | up]``."""
    inter = even("intermediate_size", m.down_proj.in_features, sh.world) * sh.world
    start, size = sh.share(inter)
    rows = [(start, size), (inter + start, size)]
    sh.column(f"{prefix}gate_up_proj.", m.gate_up_proj, rows)
    sh.adapters(f"{prefix}gate_up_proj_adapter_list.", m.gate_up_proj_adapter_list, rows)
    sh.row(f"{prefix}down_proj.", m.down_proj, (start, size))
    sh.reduce_output(m)


def split_mlp(sh: Sharder, prefix: str, m: nn.Module, gate: str, up: str, down: str) -> None:
    """A gated MLP under other names (LFM2's ``w1``, ``w3``, ``w2``)."""
    inter = getattr(m, down).in_features
    even("intermediate_size", inter, sh.world)
    share = sh.share(inter)
    sh.column(f"{prefix}{gate}.", getattr(m, gate), [share])
    sh.column(f"{prefix}{up}.", getattr(m, up), [share])
    sh.row(f"{prefix}{down}.", getattr(m, down), share)
    sh.reduce_output(m)


def xlstm_feed_forward(sh: Sharder, prefix: str, m: nn.Module) -> None:
    up = even("the feed-forward width", m.up_dim, sh.world) * sh.world
    start, size = sh.share(up)
    if m.fused:
        sh.column(f"{prefix}proj_up_gate_z.", m.proj_up_gate_z, [(start, size), (up + start, size)])
    else:
        sh.column(f"{prefix}proj_up_gate.", m.proj_up_gate, [(start, size)])
        sh.column(f"{prefix}proj_up.", m.proj_up, [(start, size)])
    sh.row(f"{prefix}proj_down.", m.proj_down, (start, size))
    m.up_dim = size
    sh.reduce_output(m)


def experts(sh: Sharder, prefix: str, m: FusedExperts) -> None:
    """Every expert keeps its slice of the intermediate channels; a shared expert's output (already
    summed) is added on rank 0 only."""
    inter = m.intermediate_size
    even("moe_intermediate_size", inter, sh.world)
    start, size = sh.share(inter)
    e, d_in = m.down_proj.shape[0], m.down_proj.shape[1]
    if m.gated:
        rows = [(start, size), (inter + start, size)]  # gate rows, then up rows
        sh.param(prefix, m, "gate_up_proj", (e, 2 * size, d_in), slicer(1, rows))
    else:
        sh.param(prefix, m, "up_proj", (e, size, d_in), slicer(1, [(start, size)]))
    sh.param(prefix, m, "down_proj", (e, d_in, size), slicer(2, [(start, size)]))
    m.intermediate_size = size
    if sh.rank != 0:
        m.register_forward_pre_hook(_drop_shared, with_kwargs=True)
    sh.reduce_output(m)


def embedding(sh: Sharder, prefix: str, m: Embedding) -> None:
    vocab = m.num_embeddings
    local = -(-vocab // sh.world)
    start = sh.rank * local
    real = max(0, min(vocab, start + local) - start)
    sh.param(prefix, m, "weight", (local, m.embedding_dim), slicer(0, [(start, real)], pad_to=local))
    m.__class__ = VocabParallelEmbedding
    m.num_embeddings, m.vocab_start, m.group = local, start, sh.group


def lm_head(sh: Sharder, prefix: str, m: nn.Linear, vocab: int) -> None:
    local = -(-vocab // sh.world)
    start = sh.rank * local
    real = max(0, min(vocab, start + local) - start)
    sh.param(prefix, m, "weight", (local, m.in_features), slicer(0, [(start, real)], pad_to=local))
    if m.bias is not None:
        sh.param(prefix, m, "bias", (local,), slicer(0, [(start, real)], pad_to=local))
    m.out_features = local


def _drop_shared(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """FusedExperts on ranks other than 0: no shared-expert output to add (rank 0 adds it once)."""
    if len(args) > 3:
        args = args[:3]
    kwargs.pop("shared", None)
    return args, kwargs
