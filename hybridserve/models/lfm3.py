"""LFM3 (Liquid AI): LFM2's gated short-conv layers, full-attention layers and sliding-window attention layers.

Each attention layer has per-head q/k RMS norms, RoPE of its layer type (``config.rope_parameters`` keyed
``full_attention`` / ``sliding_attention``: ``default``, or ``proportional``, which rotates the first
``partial_rotary_factor`` of the head's frequency pairs and leaves the rest unrotated) and, with
``use_attention_gate``, a per-head output gate ``sigmoid(g_proj(x))``. A sliding-window layer attends to the
last ``sliding_window`` positions, its own included (HF's ``kv_idx > q_idx - sliding_window``). With
``use_sandwich_norm``, the operator's and the feed-forward's outputs are RMS-normed
(``post_operator_norm``, ``post_ffn_norm``) before their residual adds. The MLP is ``w2(silu(w1 x) * w3 x)``
at ``intermediate_size`` (no LFM2 width adjustment); the final norm is ``embedding_norm``.

Caches: a conv window per short-conv layer (a conv state, ``mamba_cache_dtype``), KV per attention layer;
the sliding-window layers' KV is a page group of its own whose pages behind the window go back to the
pool while a request runs (docs/sliding_window.md). RoPE cos/sin are in the model dtype (HF keeps them
in float32: identical for a float32 model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import CausalLM
from hybridserve.models.lfm2 import Lfm2MLP, Lfm2ShortConv, head_dim_of

ATTENTION_KINDS = ("full_attention", "sliding_attention")
LAYER_KINDS = ("conv", *ATTENTION_KINDS)
ROPE_TYPES = ("default", "proportional")


class Lfm3RotaryEmbedding(RotaryEmbedding):
    """RoPE of one layer type over the whole head (``rotary_dim == head_dim``): ``default`` rotates every
    frequency pair; ``proportional`` the first ``int(partial_rotary_factor * head_dim / 2)`` pairs, with
    exponents over the whole head, the others at frequency 0 (cos 1, sin 0: unchanged). Frequencies are
    divided by ``factor`` (default 1)."""

    def __init__(self, config: Any, head_dim: int, layer_type: str) -> None:
        nn.Module.__init__(self)
        self.config, self.layer_type, self.rotary_dim = config, layer_type, head_dim
        inv_freq, scaling = self._inv_freq({})
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scaling)

    def _inv_freq(self, params: dict) -> tuple[torch.Tensor, float]:
        params = self.config.rope_parameters[self.layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters[{self.layer_type!r}]: rope_type={rope_type!r} is not supported; "
                             f"supported: {', '.join(ROPE_TYPES)}")
        dim = self.rotary_dim
        pairs = dim // 2 if rope_type == "default" else int(params.get("partial_rotary_factor", 1.0) * dim // 2)
        exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.float32, device="cpu") / dim  # (pairs,)
        inv_freq = torch.zeros(dim // 2, dtype=torch.float32)  # (dim / 2,)
        inv_freq[:pairs] = 1.0 / (float(params["rope_theta"]) ** exponents)
        if rope_type == "proportional":
            inv_freq /= float(params.get("factor", 1.0))
        return inv_freq, 1.0


def _layer_kinds(config: Any) -> list[str]:
    kinds = list(config.layer_types)
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise ValueError(f"LFM3 layer {i}: layer_types entry {kind!r} is not supported; "
                             f"supported: {', '.join(LAYER_KINDS)}")
    if "sliding_attention" in kinds and not config.sliding_window:
        raise ValueError(f"sliding_window={config.sliding_window!r}: sliding_attention layers need a "
                         "positive window")
    return kinds


class Lfm3DecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, kind: str, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.kind = kind
        if kind == "conv":
            self.conv = Lfm2ShortConv(config, index, dtypes)
        else:
            self.self_attn = Attention(index, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, head_dim_of(config), dtypes,
                                       bias=bool(config.attention_bias), qk_norm_eps=config.norm_eps,
                                       sliding_window=config.sliding_window if kind == "sliding_attention"
                                       else None, head_gate=bool(config.use_attention_gate))
        self.feed_forward = Lfm2MLP(config, config.intermediate_size)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.sandwich = bool(config.use_sandwich_norm)
        if self.sandwich:
            self.post_operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.post_ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous feed-forward's output, not yet added (or None). Returns
        (x, this layer's feed-forward output), each residual add fused into the next norm."""
        x, h = (x, self.operator_norm(x)) if pending is None else self.operator_norm.add_and_norm(x, pending)
        h = self.conv(h, batch) if self.kind == "conv" else self.self_attn(h, rope, batch)
        if self.sandwich:
            h = self.post_operator_norm(h)
        x, h = self.ffn_norm.add_and_norm(x, h)
        h = self.feed_forward(h)
        return x, self.post_ffn_norm(h) if self.sandwich else h


class Lfm3Model(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        kinds = _layer_kinds(config)
        self.layer_kinds = kinds[:config.num_hidden_layers]
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Lfm3DecoderLayer(config, i, kind, dtypes)
                                    for i, kind in enumerate(self.layer_kinds))
        self.rotary_emb = nn.ModuleDict({kind: Lfm3RotaryEmbedding(config, head_dim_of(config), kind)
                                         for kind in ATTENTION_KINDS if kind in self.layer_kinds})
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)


class Lfm3ForCausalLM(CausalLM):
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    # checkpoints store the output gate as ``gate_proj`` (HF renames it to ``g_proj`` on load)
    checkpoint_renames = [(r"\.self_attn\.gate_proj\.", ".self_attn.g_proj.")]

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = Lfm3Model(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden)."""
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        ropes = {kind: emb(positions, x.dtype) for kind, emb in self.model.rotary_emb.items()}  # (T, Dh) each
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, ropes.get(layer.kind), batch)
        return self.model.embedding_norm.add_and_norm(x, pending)[1]
