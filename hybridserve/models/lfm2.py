"""LFM2 (Liquid AI): gated short-convolution layers and attention layers (per-head q/k RMS norms),
each followed by a SwiGLU MLP; the final norm is HF's ``embedding_norm``.

Layer kinds come from ``config.layer_types`` (``conv`` / ``full_attention``). A short-conv layer:
``B, C, x = in_proj(h)``; ``y = C * conv(B * x)`` (depthwise causal conv, no activation);
``out_proj(y)``. Its state is the conv window ``conv (hidden, L_cache-1)``, a conv state (follows
``mamba_cache_dtype``); LFM2 has no temporal state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mlp import ActAndMul
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.layers.state_shapes import short_conv_spec
from hybridserve.models.base import RopeDecoderLM
from hybridserve.ops.short_conv import gated_short_conv


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def ffn_size(config: Any) -> int:
    """The MLP width, adjusted as HF's ``Lfm2MLP`` does (2/3, multiplier, rounded up to a multiple)."""
    size = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * ((size + config.block_multiple_of - 1) // config.block_multiple_of)
    return size


class Lfm2MLP(nn.Module):
    """``w2(silu(w1(x)) * w3(x))`` (HF names)."""

    def __init__(self, config: Any, size: int | None = None) -> None:
        super().__init__()
        size = size or ffn_size(config)
        self.w1 = nn.Linear(config.hidden_size, size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, size, bias=False)
        self.w2 = nn.Linear(size, config.hidden_size, bias=False)
        self.act_and_mul = ActAndMul("silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_and_mul(self.w1(x), self.w3(x)))


class Lfm2ShortConv(nn.Module):
    """Gated short convolution over the pooled conv state (HF weight names)."""

    def __init__(self, config: Any, layer_index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.layer_index = layer_index
        hidden, kernel = config.hidden_size, config.conv_L_cache
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=config.conv_bias, padding=kernel - 1)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=config.conv_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=config.conv_bias)
        self.spec = short_conv_spec(layer_index, dtypes, hidden=hidden, conv_kernel=kernel)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        conv_states = batch.caches[self.layer_index].state["conv"]  # (slots, hidden, K-1)
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # (T, hidden) each
        return self.out_proj(gated_short_conv(self.conv, b, c, h, batch, conv_states))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes, feed_forward: nn.Module | None = None) -> None:
        super().__init__()
        self.is_attention = config.layer_types[index] != "conv"
        if self.is_attention:
            self.self_attn = Attention(index, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, head_dim_of(config), dtypes,
                                       qk_norm_eps=config.norm_eps)
        else:
            self.conv = Lfm2ShortConv(config, index, dtypes)
        self.feed_forward = feed_forward if feed_forward is not None else Lfm2MLP(config)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous feed-forward's output, not yet added (or None). Returns
        (x, this layer's feed-forward output), each residual add fused into the next norm."""
        x, h = (x, self.operator_norm(x)) if pending is None else self.operator_norm.add_and_norm(x, pending)
        x, h = self.ffn_norm.add_and_norm(x, self.self_attn(h, rope, batch) if self.is_attention
                                          else self.conv(h, batch))
        return x, self.feed_forward(h)


class Lfm2Model(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes, feed_forward=None) -> None:
        """``feed_forward(config, index)``: a layer's feed-forward module (default: the SwiGLU MLP)."""
        super().__init__()
        kinds = getattr(config, "layer_types", None)
        if not isinstance(kinds, (list, tuple)) or len(kinds) < config.num_hidden_layers:
            raise ValueError(f"config.json has no layer_types for its {config.num_hidden_layers} layers (the kind of "
                             f"each layer: conv or full_attention); got {kinds!r}")
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Lfm2DecoderLayer(config, i, dtypes, feed_forward(config, i) if feed_forward else None)
            for i in range(config.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)


class Lfm2LMBase(RopeDecoderLM):
    final_norm = "embedding_norm"
    fused_residual = True
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    # HF's attention names -> layers.attention.Attention's
    checkpoint_renames = [(r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
                          (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
                          (r"\.self_attn\.out_proj\.", ".self_attn.o_proj.")]

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = Lfm2Model(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class Lfm2ForCausalLM(Lfm2LMBase):
    """LFM2 (HF weight names)."""
