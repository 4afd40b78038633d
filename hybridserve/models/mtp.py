"""Multi-token-prediction (MTP) heads: the draft modules some checkpoints ship beside the model (``mtp.*``).

An MTP module predicts the token after next: from the target model's final (normed) hidden state at
position ``p`` and the embedding of the token at ``p + 1`` it computes a hidden state whose logits (the
target's LM head) predict the token at ``p + 2``. The layout per family (docs/mtp.md):

* Qwen3-Next, Qwen3.5 (dense, MoE, and their vision-language checkpoints), ``mtp_num_hidden_layers``
  modules: ``fc(cat([pre_fc_norm_embedding(embed(ids)), pre_fc_norm_hidden(hidden)]))``, then one of
  ``layers.{i}`` (a full-attention decoder layer with the target's MLP/MoE), then ``norm``
  (``models/mtp_qwen3_next.py``).
* Nemotron-H, ``num_nextn_predict_layers`` modules, each a group of blocks of the kinds
  ``mtp_layers_block_type`` names (attention, MoE, MLP): the first block fuses ``eh_proj(cat([enorm(embed),
  hnorm(hidden)]))``, the last ends in ``final_layernorm`` (``models/mtp_nemotron_h.py``).

A head is its own module tree (so ``enable_cpu_kernels`` and ``pack_kernel_linear_layers`` apply to it) that
shares the target's embedding (and RoPE) modules (on rank 0 of a tensor-parallel target, whole copies of
the embedding and the LM head: :func:`use_whole_vocabulary`); its attention caches are specs of their own,
indexed from ``first_layer_index`` on, in the same pool as the target's.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.distributed.layers import VocabParallelEmbedding
from hybridserve.layers.embedding import Embedding
from hybridserve.models import registry
from hybridserve.models.base import CausalLM
from hybridserve.models.loader import checkpoint_tensors, load_weights, weight_files
from hybridserve.models.mtp_base import MTP_NAME, MTPHead
from hybridserve.models.mtp_config import mtp_count_key, mtp_layer_count

__all__ = ["MTP_FAMILIES", "MTP_NAME", "MTPHead", "build_mtp_head", "mtp_weight_names", "use_whole_vocabulary"]


#: the families with an MTP head, for error messages
MTP_FAMILIES = "Qwen3-Next, Qwen3.5, Qwen3.5-MoE (and their vision-language checkpoints), Nemotron-H"


def mtp_weight_names(path: str) -> list[str]:
    """The checkpoint's raw ``mtp.*`` tensor names."""
    names = []
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            names += [n for n in f.keys() if re.match(MTP_NAME, n)]
    return names


def build_mtp_head(path: str, hf_config: Any, target: CausalLM, dtype: torch.dtype, dtypes: CacheDtypes,
                   device: torch.device, first_layer_index: int) -> MTPHead:
    """Construct the target family's MTP head on the meta device and load the checkpoint's ``mtp.*``
    weights (which the target's loader skips) in ``dtype`` on ``device``, strictly (every name and shape);
    it shares the target's embedding and LM head (no copy), or, when the target is a tensor-parallel shard
    (rank 0's), holds whole copies of them (:func:`use_whole_vocabulary`). ValueError naming the family and
    what is missing when the family has no MTP head, the config declares none, or the checkpoint holds no
    MTP weights; or when a head cache index would collide with the target's."""
    head_cls = registry.mtp_head_class(type(target))
    arch = type(target).__name__
    if head_cls is None:
        raise ValueError(f"{arch} has no multi-token-prediction (MTP) head; families with one: {MTP_FAMILIES}")
    num_layers = mtp_layer_count(hf_config)
    if num_layers == 0:
        key = mtp_count_key(hf_config) or "the MTP layer count"
        raise ValueError(f"{arch} checkpoint {path!r} declares no MTP layers ({key} is 0 or absent in config.json)")
    if not mtp_weight_names(path):
        raise ValueError(f"{arch} checkpoint {path!r} declares {num_layers} MTP layers but holds no MTP weights "
                         "(no mtp.* tensors in its safetensors)")
    if first_layer_index < 0:
        raise ValueError(f"first_layer_index must be >= 0, got {first_layer_index}")
    with torch.device("meta"):
        head = head_cls(hf_config, target, dtypes, num_layers, first_layer_index)
    taken = {s.index for s in target.cache_specs()}
    clash = sorted(taken & {s.index for s in head.cache_specs()})
    if clash:
        raise ValueError(f"MTP cache indices {clash} collide with {arch}'s layers (indices {min(taken)}..."
                         f"{max(taken)}); pass a first_layer_index above them")
    load_weights(head, path, dtype, device)
    head.share(target)
    if getattr(target, "tp_slicers", None):  # rank 0 of a tensor-parallel target: the head runs whole
        use_whole_vocabulary(head, target, path, dtype, device)
    head.eval()
    head.requires_grad_(False)
    return head


def use_whole_vocabulary(head: MTPHead, target: CausalLM, path: str, dtype: torch.dtype,
                         device: torch.device) -> None:
    """Give ``head`` (on rank 0 of a tensor-parallel target, whose embedding and LM head hold a slice of the
    vocabulary each and all-reduce/gather across the ranks) whole copies of the embedding it shares and of
    the LM head, read from the checkpoint here (the other ranks never run the head). The LM head of a tied
    checkpoint is the embedding copy's weight."""
    if target.lm_head.bias is not None:
        raise ValueError("an MTP head under tensor parallelism takes an LM head without bias")
    names = {id(m): n for n, m in target.named_modules()}
    embeddings = {attr: m for attr, m in head.shared_modules(target).items() if isinstance(m, VocabParallelEmbedding)}
    wanted = {f"{names[id(m)]}.weight" for m in embeddings.values()} | {f"{names[id(target.lm_head)]}.weight"}
    skip, renames = getattr(target, "checkpoint_skip", None), getattr(target, "checkpoint_renames", [])
    found: dict[str, torch.Tensor] = {}
    for f, raw, name in checkpoint_tensors(path, renames, skip):
        if name in wanted:
            found[name] = f.get_tensor(raw).to(device=device, dtype=dtype)
    lm_name = f"{names[id(target.lm_head)]}.weight"
    source = target.tied_weights.get(lm_name)
    if getattr(target.hf_config, "tie_word_embeddings", False) and source in found:
        found[lm_name] = found[source]  # as the target ties them (one copy)
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {missing}, which the MTP head needs whole under tensor "
                         "parallelism")
    for attr, module in embeddings.items():
        weight = found[f"{names[id(module)]}.weight"]
        with torch.device("meta"):
            whole = Embedding(weight.shape[0], weight.shape[1])
        whole.weight = nn.Parameter(weight, requires_grad=False)
        setattr(head, attr, whole)
    weight = found[lm_name]
    with torch.device("meta"):
        lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lm_head.weight = nn.Parameter(weight, requires_grad=False)
    head.lm_head = lm_head
