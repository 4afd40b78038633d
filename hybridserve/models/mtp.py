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

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import fallbacks
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.models import registry
from hybridserve.models.base import CausalLM, merge_specs
from hybridserve.models.mtp_config import mtp_count_key, mtp_layer_count

#: a raw checkpoint name of an MTP weight: ``mtp.*``, also under a vision-language wrapper's language model
MTP_NAME = r"^(?:model\.language_model\.|language_model\.)?mtp\."

class MTPHead(nn.Module):
    """Base of the family heads: cache specs, the shared modules, the loader's hooks.

    Subclasses build their own modules in ``__init__`` (on the meta device; the loader fills them), name
    the target's modules they share in :meth:`shared_modules`, and implement :meth:`forward`.
    """

    #: the loader's hooks (``loader.load_weights``): only ``mtp.*`` is read, loaded without the prefix
    checkpoint_skip = rf"(?!{MTP_NAME[1:]})"
    checkpoint_renames = [(MTP_NAME, "")]
    tied_weights: dict[str, str] = {}
    use_cpu_kernels = False  # set by enable_cpu_kernels (the concat before the fusing projection)

    def __init__(self, hf_config: Any, num_layers: int, first_layer_index: int) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.num_layers = num_layers
        self.first_layer_index = first_layer_index

    def cache_specs(self) -> list[LayerCacheSpec]:
        """Its layers' cache specs, indices ``first_layer_index``, ``first_layer_index + 1``, ..."""
        return merge_specs([m.spec for m in self.modules() if isinstance(getattr(m, "spec", None), LayerCacheSpec)])

    def shared_modules(self, target: CausalLM) -> dict[str, nn.Module]:
        """Attribute name -> the target's module the head uses as its own (the embedding, say)."""
        raise NotImplementedError

    def share(self, target: CausalLM) -> None:
        """Attach the target's shared modules (after loading: ``to_empty`` must not touch them) and keep a
        reference to the target, not registered as a submodule (its layers are not the head's)."""
        for name, module in self.shared_modules(target).items():
            setattr(self, name, module)
        object.__setattr__(self, "target", target)

    def tie_weights_if_needed(self) -> None:
        """Nothing to tie: the embedding and the LM head are the target's (``share``)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> float32 logits (N, vocab) through the target's LM head (its whole copy
        ``self.lm_head`` under tensor parallelism: :func:`use_whole_vocabulary`)."""
        lm_head = self._modules.get("lm_head")
        if lm_head is None:
            return self.target.compute_logits(hidden)
        logits = lm_head(hidden).float()
        scale = self.target.logits_scale
        return logits * scale if scale != 1.0 else logits

    def layer_for(self, step: int) -> int:
        """The MTP module a speculative ``step`` runs: ``step % num_layers``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step % self.num_layers

    def concat(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a (T, Da), b (T, Db) -> (T, Da + Db), by the CPU kernel when it is on."""
        if self.use_cpu_kernels:
            joined = pointwise_kernels.concat_cols(a, b)
            if joined is not None:
                return joined
            fallbacks.record("concat_cols", fallbacks.describe(a, b))
        return torch.cat([a, b], dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch, step: int = 0) -> torch.Tensor:
        """Row i: ``positions[i] = p``, ``hidden[i]`` the target's final normed hidden state at p,
        ``input_ids[i]`` the token at p + 1. Returns (T, hidden) normed hidden states whose
        ``compute_logits`` predict the token at p + 2; module ``step % num_layers`` runs, its attention
        KV for row i written at position p through ``batch.slot_mapping``."""
        raise NotImplementedError


#: the families with an MTP head, for error messages
MTP_FAMILIES = "Qwen3-Next, Qwen3.5, Qwen3.5-MoE (and their vision-language checkpoints), Nemotron-H"


def mtp_weight_names(path: str) -> list[str]:
    """The checkpoint's raw ``mtp.*`` tensor names."""
    from hybridserve.models.loader import weight_files

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
    from hybridserve.models.loader import load_weights

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
    from hybridserve.distributed.layers import VocabParallelEmbedding
    from hybridserve.layers.embedding import Embedding
    from hybridserve.models.loader import checkpoint_tensors

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
