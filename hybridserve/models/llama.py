"""Llama: attention only (the pool then holds KV pages and no state slots)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mlp import GatedMLP
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import RopeDecoderLM


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(index, config.hidden_size, config.num_attention_heads,
                                   config.num_key_value_heads, head_dim_of(config), dtypes,
                                   bias=getattr(config, "attention_bias", False))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            getattr(config, "mlp_bias", False))

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous MLP's output, not yet added (or None). Returns (x, this
        layer's MLP output), its residual add fused into the next norm."""
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add_and_norm(x, pending)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, rope, batch))
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtypes) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))


class LlamaForCausalLM(RopeDecoderLM):
    fused_residual = True
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
