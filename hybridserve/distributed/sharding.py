"""Megatron-style sharding of a model built on the meta device, before its weights load.

Each sharded layer gets per-rank parameter shapes, its attributes and cache spec rewritten to the rank's
slice (heads, groups, channels), and a slicer per parameter that cuts the rank's part out of the full
checkpoint tensor (``model.tp_slicers``, applied by the loader). Column-parallel projections keep their
rows of each fused segment; row-parallel projections keep their columns, their bias on rank 0 only, and
the layer's output is summed over the ranks (a forward hook). Embedding and LM head hold a slice of the
vocabulary (padded to a multiple of the ranks); the logits are gathered by :func:`gather_logits`.

This module walks the model and dispatches each layer to its sharder: ``shard_attention``,
``shard_recurrent``, ``shard_dense`` (over the toolkit in ``sharder``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from hybridserve.distributed import shard_attention, shard_dense, shard_recurrent
from hybridserve.distributed.group import RankGeometry, TPGroup
from hybridserve.distributed.sharder import Sharder
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.gated_deltanet import GatedDeltaNet
from hybridserve.layers.mamba1 import Mamba1Mixer
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.mlp import GatedMLP, PlainMLP
from hybridserve.layers.moe import FusedExperts
from hybridserve.models import registry


def check_supported(architecture: str, world: int) -> None:
    """ValueError unless ``architecture`` can run on ``world`` > 1 tensor-parallel ranks."""
    supported = registry.tensor_parallel_architectures()
    if world > 1 and architecture not in supported:
        raise ValueError(f"tensor parallel is not supported for {architecture} yet (supported: "
                         f"{', '.join(supported)}); run it with tensor_parallel_size=1")


def shard_model(model: nn.Module, architecture: str, group: TPGroup | RankGeometry) -> None:
    """Shard ``model`` (built on the meta device) for ``group``'s rank; sets ``model.tp_slicers`` and
    ``model.tp_vocab_size``. A config whose counts cannot be split raises ValueError naming them."""
    check_supported(architecture, group.world)
    sh = Sharder(group)
    vocab = model.hf_config.vocab_size
    a, r, d = shard_attention, shard_recurrent, shard_dense
    handlers: list[tuple[type, Callable[[Sharder, str, Any], None]]] = [
        (Attention, a.attention), (Mamba2Mixer, r.mamba2), (GatedMLP, d.gated_mlp), (PlainMLP, d.plain_mlp),
        (FusedExperts, d.experts), (Embedding, d.embedding), (GatedDeltaNet, r.gated_delta_net),
        (Mamba1Mixer, r.mamba1)]
    named: dict[str, Callable[[Sharder, str, Any], None]] = {  # a family's own layers, by class name
        "GraniteMoeHybridMLP": lambda sh, p, m: d.fused_gate_up_mlp(sh, p, m, "input_linear", "output_linear"),
        "Lfm2MLP": lambda sh, p, m: d.split_mlp(sh, p, m, "w1", "w3", "w2"),
        "FalconH1MLP": d.gated_mlp, "Zamba2MLP": d.zamba2_mlp, "XLSTMFeedForward": d.xlstm_feed_forward,
        "FalconH1Attention": a.attention, "Zamba2Attention": a.attention,
        "OlmoHybridAttention": a.whole_projection_norm_attention, "LatentAttention": a.latent_attention,
        "LightningAttention": a.lightning_attention, "KimiDeltaAttention": r.kda, "Lfm2ShortConv": r.short_conv,
        "MLSTMLayer": r.mlstm}
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        by_name = named.get(type(module).__name__)
        if by_name is not None:
            by_name(sh, prefix, module)
            continue
        for cls, handler in handlers:
            if type(module) is cls:
                handler(sh, prefix, module)
                break
            if isinstance(module, cls):  # a subclass may compute over more than one rank's slice
                raise ValueError(f"tensor parallel is not supported for {architecture} yet: its "
                                 f"{type(module).__name__} ({name}) is not sharded")
    d.lm_head(sh, "lm_head.", model.lm_head, vocab)
    model.tp_slicers = sh.slicers
    model.tp_vocab_size = vocab
    model.tp_group = group


def gather_logits(model: nn.Module, method: str, hidden: torch.Tensor) -> torch.Tensor:
    """``model.<method>(hidden)`` (compute_logits or sampling_logits) over the whole vocabulary: each rank's
    slice (N, V / ranks), gathered (N, V)."""
    local = getattr(model, method)(hidden)  # (N, V_local)
    full = model.tp_group.all_gather_last(local)  # (N, ranks * V_local)
    vocab = model.tp_vocab_size
    return full if full.shape[-1] == vocab else full[:, :vocab].contiguous()


def check_shardable(hf_config: Any, cache_dtypes: Any, world: int) -> None:
    """Shard a meta copy of the model for rank 0 of ``world``: ValueError (naming the counts, or the
    architecture) when it cannot run tensor-parallel. Cheap: no weights are read."""
    from hybridserve.models import fp8_checkpoint

    architecture = registry.architecture_of(hf_config)
    check_supported(architecture, world)
    if fp8_checkpoint.fp8_config(hf_config) is not None:
        raise ValueError(f"tensor parallel does not shard fp8 checkpoints yet (tensor_parallel_size={world})")
    with torch.device("meta"):
        model = registry.model_class(architecture)(hf_config, cache_dtypes)
    shard_model(model, architecture, RankGeometry(0, world))
