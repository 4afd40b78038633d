"""Qwen3.5 (dense and MoE) and its vision-language checkpoints served as text.

Qwen3.5's text model is Qwen3-Next's computation, so its layers are Qwen3-Next's (``models/qwen3_next.py``):

* gated delta net: the same conv, recurrence and gated norm; only the checkpoint stores the projections
  apart (``in_proj_qkv`` ``[all q | all k | all v]``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) where
  Qwen3-Next groups them per key head. ``transform_checkpoint`` reorders the rows into Qwen3-Next's
  ``in_proj_qkvz`` / ``in_proj_ba`` (``layers/gated_deltanet.py: grouped_projections``), so the layer and
  its CPU kernels are Qwen3-Next's unchanged.
* gated attention with zero-centered q/k norms, partial RoPE, zero-centered RMS norms: Qwen3-Next's.
* RoPE: HF's interleaved M-RoPE (Qwen3-VL) rotates frequency j by the temporal, height or width position
  stream as ``mrope_section`` assigns it; for text the three streams are the token position, so it is
  plain RoPE over ``partial_rotary_factor * head_dim`` (``tests/models/test_qwen3_5.py`` checks HF's against ours).
* feed-forward: the dense model has a SwiGLU MLP on every layer; the MoE model a sparse MoE block on every
  layer (no ``mlp_only_layers`` / ``decoder_sparse_step``): Qwen3-Next's softmax top-k router, always
  renormalized over the chosen experts, plus the sigmoid-gated shared expert.

``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` checkpoints hold the same
language model under ``model.language_model.*`` beside a vision tower (``model.visual.*``): served as
text, the vision weights are never read (``checkpoint_skip``), nor is the multi-token-prediction head
(``mtp.*``, which HF ignores as well).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridserve.cache.spec import CacheDtypes
from hybridserve.layers.gated_deltanet import grouped_projections
from hybridserve.models.qwen3_next import Qwen3NextLMBase

#: Qwen3.5's separate gated-delta-net projections, in the order ``grouped_projections`` takes them
_SPLIT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def text_config_of(config: Any) -> Any:
    """The language model's config: ``text_config`` of a vision-language config, else the config itself."""
    text = getattr(config, "text_config", None)
    return config if text is None else text


class Qwen3NextView:
    """A Qwen3.5 text config read as Qwen3-Next's: the MoE keys Qwen3.5's config classes drop take the
    values that give Qwen3.5's layers (``fixed``); every other key is the config's own."""

    def __init__(self, config: Any, **fixed: Any) -> None:
        self._config, self._fixed = config, fixed

    def __getattr__(self, name: str) -> Any:
        fixed = self.__dict__.get("_fixed", {})
        return fixed[name] if name in fixed else getattr(self.__dict__["_config"], name)


class Qwen3_5ForCausalLM(Qwen3NextLMBase):
    """Qwen3.5, dense: a SwiGLU MLP on every layer."""

    #: raw checkpoint names not read at all
    checkpoint_skip = r"^mtp\."
    #: the Qwen3-Next keys this family's configs lack (every layer dense)
    qwen3_next_keys: dict[str, Any] = {"num_experts": 0, "mlp_only_layers": [], "decoder_sparse_step": 1}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        view = Qwen3NextView(text_config_of(config), **self.qwen3_next_keys)
        super().__init__(view, dtypes)
        self.hf_config = config  # tie_word_embeddings: the top-level config's, as in HF

    def transform_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Qwen3-Next's (stacked experts), after reordering each gated delta net's separate projections
        into Qwen3-Next's grouped ones; a ValueError names a layer's missing or mis-shaped projections."""
        tensors = dict(tensors)
        for i, layer in enumerate(self.model.layers):
            if layer.kind != "linear_attention":
                continue
            gdn, prefix = layer.linear_attn, f"model.layers.{i}.linear_attn."
            names = [f"{prefix}{p}.weight" for p in _SPLIT_PROJECTIONS]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"checkpoint lacks the gated delta net projections {missing}")
            try:
                hk, hv = gdn.checkpoint_heads  # the checkpoint's (whole) head counts, tensor-parallel or not
                qkvz, ba = grouped_projections(*(tensors.pop(n) for n in names), num_k_heads=hk, num_v_heads=hv,
                                               head_k_dim=gdn.head_k_dim, head_v_dim=gdn.head_v_dim)
            except ValueError as exc:
                raise ValueError(f"layer {i}: {exc}") from None
            tensors[f"{prefix}in_proj_qkvz.weight"], tensors[f"{prefix}in_proj_ba.weight"] = qkvz, ba
        return super().transform_checkpoint(tensors)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: a sparse MoE block (renormalized softmax top-k, shared expert) on every layer."""

    qwen3_next_keys = {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}


class _ServedAsText:
    """A vision-language checkpoint's language model: ``model.language_model.*`` loads as ``model.*``;
    the vision tower and the multi-token-prediction head are skipped unread."""

    checkpoint_renames = [(r"^model\.language_model\.", "model.")]
    checkpoint_skip = r"^(model\.visual|mtp)\."


class Qwen3_5ForConditionalGeneration(_ServedAsText, Qwen3_5ForCausalLM):
    """Qwen3.5's vision-language checkpoint, served as text."""


class Qwen3_5MoeForConditionalGeneration(_ServedAsText, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's vision-language checkpoint, served as text."""


__all__ = ["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
           "Qwen3_5MoeForConditionalGeneration", "text_config_of"]
