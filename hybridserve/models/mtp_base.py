"""The base of the multi-token-prediction (MTP) heads: :class:`MTPHead` and the checkpoint names it loads.

The family heads (``models/mtp_qwen3_next.py``, ``models/mtp_nemotron_h.py``) subclass it; ``models/mtp.py``
picks and builds one (docs/mtp.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import LayerCacheSpec
from hybridserve.forward_batch import ForwardBatch
from hybridserve.models.base import CausalLM, merge_specs
from hybridserve.ops.elementwise import concat_cols

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
    target: CausalLM  # the model it drafts for, set by share() (not a submodule)

    def __init__(self, hf_config: Any, num_layers: int, first_layer_index: int) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.num_layers = num_layers
        self.first_layer_index = first_layer_index

    def cache_specs(self) -> list[LayerCacheSpec]:
        """Its layers' cache specs, indices ``first_layer_index``, ``first_layer_index + 1``, ..."""
        return merge_specs([spec for m in self.modules()
                            if isinstance(spec := getattr(m, "spec", None), LayerCacheSpec)])

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
        """a (T, Da), b (T, Db) -> (T, Da + Db)."""
        return concat_cols(a, b)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch, step: int = 0) -> torch.Tensor:
        """Row i: ``positions[i] = p``, ``hidden[i]`` the target's final normed hidden state at p,
        ``input_ids[i]`` the token at p + 1. Returns (T, hidden) normed hidden states whose
        ``compute_logits`` predict the token at p + 2; module ``step % num_layers`` runs, its attention
        KV for row i written at position p through ``batch.slot_mapping``."""
        raise NotImplementedError
