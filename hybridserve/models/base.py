"""Shared pieces of every causal LM: cache-spec collection, logits, tied embeddings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import LayerCacheSpec
from hybridserve.engine.forward_batch import ForwardBatch
from hybridserve.kernels.program import Unsupported
from hybridserve.layers.attention import Attention


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


class CausalLM(nn.Module):
    """Base class: subclasses set ``self.lm_head`` and implement ``forward``.

    ``forward(input_ids (T,), positions (T,), batch) -> hidden (T, hidden)``; ``compute_logits``
    maps selected hidden rows to float32 logits.
    """

    #: HF weight names that may be absent from a checkpoint (e.g. a tied ``lm_head.weight``).
    tied_weights: dict[str, str] = {}

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.logits_scale = 1.0

    def cache_specs(self) -> list[LayerCacheSpec]:
        """Every cache spec declared by a submodule (attribute ``spec``), merged per index."""
        specs = [m.spec for m in self.modules() if isinstance(getattr(m, "spec", None), LayerCacheSpec)]
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
        """Share the LM head with the embeddings when the config ties them."""
        if getattr(self.hf_config, "tie_word_embeddings", False):
            for dst, src in self.tied_weights.items():
                owner, name = _resolve(self, dst)
                setattr(owner, name, _resolve_param(self, src))



class RopeDecoderLM(CausalLM):
    """A decoder whose ``self.model`` has ``embed_tokens``, ``rotary_emb``, ``layers`` (each called as
    ``layer(x, rope, batch)``) and a final norm named by ``final_norm``."""

    final_norm = "norm"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        rope = self.model.rotary_emb(positions, x.dtype)  # (cos, sin), each (T, rotary_dim)
        for layer in self.model.layers:
            x = layer(x, rope, batch)
        return getattr(self.model, self.final_norm)(x)

def emit_decoder(program, caches: dict, embedding: nn.Embedding, layers: list[tuple], final_norm: nn.Module,
                 embedding_scale: float = 1.0, rotary_emb: nn.Module | None = None) -> torch.Tensor:
    """Add a pre-norm hybrid decoder's decode step to ``program`` (a ``kernels.program.ProgramBuilder``):
    ``x = embedding(ids) * embedding_scale``; per layer ``x += mixer(input_norm(x)) * s`` then
    ``x += mlp(post_norm(x)) * s``; ``final_norm(x)``. Each residual add is fused into the norm after it,
    as the modules do. ``layers``: ``(input_norm, mixer, post_norm, mlp, s)`` per layer, the mixer a
    ``Mamba2Mixer`` or an ``Attention`` (rotated by ``rotary_emb`` when given). Returns the output buffer."""
    if not layers:
        raise Unsupported("a model without layers has no decode program")
    hidden, dtype = embedding.embedding_dim, embedding.weight.dtype
    x = program.buffer(hidden, dtype)  # (rows, hidden) the residual stream, updated in place
    h = program.buffer(hidden, dtype)  # (rows, hidden) the normed input of a mixer or MLP
    mixed = program.buffer(hidden, dtype)  # (rows, hidden) a mixer's output
    mlp_out = program.buffer(hidden, dtype)  # (rows, hidden) an MLP's output, added by the next norm
    out = program.buffer(hidden, dtype)  # (rows, hidden) the final norm's output
    program.embed(embedding.weight, x, embedding_scale)
    for i, (input_norm, mixer, post_norm, mlp, scale) in enumerate(layers):
        input_norm.emit(program, x, h, *((mlp_out, scale) if i else ()))
        if isinstance(mixer, Attention):
            mixer.emit_decode(program, h, mixed, caches[mixer.layer_index], rotary_emb)
        else:
            mixer.emit_decode(program, h, mixed, caches[mixer.layer_index])
        post_norm.emit(program, x, h, mixed, scale)
        mlp.emit_decode(program, h, mlp_out)
    final_norm.emit(program, x, out, mlp_out, layers[-1][4])
    return out


def _resolve(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, name = dotted.split(".")
    mod = root
    for p in path:
        mod = getattr(mod, p)
    return mod, name


def _resolve_param(root: nn.Module, dotted: str) -> nn.Parameter:
    owner, name = _resolve(root, dotted)
    return getattr(owner, name)
