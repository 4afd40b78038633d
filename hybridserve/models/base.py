"""Shared pieces of every causal LM: cache-spec collection, logits, tied embeddings."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from hybridserve.cache.spec import LayerCacheSpec
from hybridserve.forward_batch import ForwardBatch


def merge_specs(specs: list[LayerCacheSpec]) -> list[LayerCacheSpec]:
    """One spec per cache index: a layer with attention and state (Falcon-H1) gets both, kinds joined."""
    by_index: dict[int, LayerCacheSpec] = {}
    for spec in specs:
        old = by_index.get(spec.index)
        if old is None:
            by_index[spec.index] = spec
            continue
        if old.attention is not None and spec.attention is not None:
            raise ValueError(f"layer {spec.index} declares two attention caches")
        by_index[spec.index] = LayerCacheSpec(spec.index, f"{old.kind}+{spec.kind}",
                                              old.attention or spec.attention, old.state + spec.state)
    return [by_index[i] for i in sorted(by_index)]


class ResidualNorm(Protocol):
    """A norm that also fuses the residual add before it (``layers/norms.RMSNorm`` and its kin)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of ``x``."""
        ...

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + residual``, then the norm: (new x, normed)."""
        ...

    def add_and_norm_float32(self, x: torch.Tensor, residual: torch.Tensor, norm_rounded: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same over a float32 residual stream: (new x float32, normed)."""
        ...


class CausalLM(nn.Module):
    """Base class: subclasses set ``self.lm_head`` and implement ``forward``.

    ``forward(input_ids (T,), positions (T,), batch) -> hidden (T, hidden)``; ``compute_logits``
    maps selected hidden rows to float32 logits.
    """

    #: HF weight names that may be absent from a checkpoint (e.g. a tied ``lm_head.weight``).
    tied_weights: dict[str, str] = {}
    lm_head: nn.Module  # set by the subclass

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.logits_scale = 1.0

    def cache_specs(self) -> list[LayerCacheSpec]:
        """Every cache spec declared by a submodule (attribute ``spec``), merged per index."""
        specs = [spec for m in self.modules() if isinstance(spec := getattr(m, "spec", None), LayerCacheSpec)]
        return merge_specs(specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> logits (N, vocab) in float32."""
        logits = self.lm_head(hidden).float()
        return logits * self.logits_scale if self.logits_scale != 1.0 else logits

    def sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`compute_logits`, or the model-dtype tensor whose float32 widening it is exactly (spares
        the sampler a float32 copy of the logits when it needs none)."""
        if type(self).compute_logits is CausalLM.compute_logits and self.logits_scale == 1.0:
            return self.lm_head(hidden)
        return self.compute_logits(hidden)

    def tie_weights_if_needed(self) -> None:
        """Share the LM head with the embeddings when the config ties them (an LM head that holds its own coded
        copy instead, with no such parameter, is left as it is: a GGUF file's Q6_K head, ``models/loader.py``)."""
        if getattr(self.hf_config, "tie_word_embeddings", False):
            for dst, src in self.tied_weights.items():
                owner, name = _resolve(self, dst)
                if name in owner._parameters:
                    setattr(owner, name, _resolve_param(self, src))



class RopeDecoderLM(CausalLM):
    """A decoder whose ``self.model`` has ``embed_tokens``, ``rotary_emb``, ``layers`` and a final norm
    named by ``final_norm``. Each layer is called as ``layer(x, rope, batch) -> x``; or, with
    ``fused_residual``, as ``layer(x, pending, rope, batch) -> (x, pending)``, its last residual add
    left pending for the next norm to fuse (``RMSNorm.add_and_norm``, the same rounding)."""

    final_norm = "norm"
    fused_residual = False
    #: the decoder stack, set by the subclass: ``embed_tokens``, ``rotary_emb``, ``layers``, the final norm
    #: (each family's own module class, so typed loosely here)
    model: Any

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        rope = self.model.rotary_emb(positions, x.dtype)  # (cos, sin), each (T, rotary_dim)
        norm = getattr(self.model, self.final_norm)
        if not self.fused_residual:
            for layer in self.model.layers:
                x = layer(x, rope, batch)
            return norm(x)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, rope, batch)
        return norm(x) if pending is None else norm.add_and_norm(x, pending)[1]


def norm_with_pending(norm: ResidualNorm, x: torch.Tensor, pending: torch.Tensor | None, float32_stream: bool,
                      final: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm after a residual add left pending (Mamba and Mamba2 blocks): ``x + pending`` fused into
    the norm, the residual stream in float32 with ``float32_stream`` (``residual_in_fp32``), the final
    norm then over the float32 sum. Returns (new x, normed); with no pending add, (x, norm(x))."""
    if pending is None:
        return x, norm(x)
    if float32_stream:
        return norm.add_and_norm_float32(x, pending, norm_rounded=not final)
    return norm.add_and_norm(x, pending)


class NormMixerBlock(nn.Module):
    """A Mamba/Mamba2 block, ``residual + mixer(norm(x))``, whose residual add is left pending for the
    next norm; subclasses set ``norm``, ``mixer`` and ``residual_in_fp32``."""

    norm: ResidualNorm
    mixer: nn.Module
    residual_in_fp32: bool

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) residual stream (float32 with ``residual_in_fp32`` after the first layer);
        pending: the previous mixer's output, not yet added (or None). Returns (x, this mixer's
        output): ``x + h`` is the next norm's fused residual add."""
        x, h = norm_with_pending(self.norm, x, pending, self.residual_in_fp32)
        return x, self.mixer(h, batch)


def _resolve(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, name = dotted.split(".")
    mod = root
    for p in path:
        mod = getattr(mod, p)
    return mod, name


def _resolve_param(root: nn.Module, dotted: str) -> nn.Parameter:
    owner, name = _resolve(root, dotted)
    return getattr(owner, name)
