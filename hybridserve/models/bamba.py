"""Bamba (IBM): Mamba2 layers and attention layers, each followed by a gated MLP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.mlp import GatedMLP
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import RopeDecoderLM

ATTENTION_KINDS = ("full_attention", "attention")


def bamba_mamba_mixer(config: Any, index: int, dtypes: CacheDtypes) -> Mamba2Mixer:
    """A Mamba2 mixer from Bamba-style ``mamba_*`` config keys (Bamba, Granite-4.0-H)."""
    return Mamba2Mixer(
        index, config.hidden_size, num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
        d_state=config.mamba_d_state, n_groups=config.mamba_n_groups, conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size, dtypes=dtypes,
        intermediate_size=int(config.mamba_expand * config.hidden_size), conv_bias=config.mamba_conv_bias,
        proj_bias=config.mamba_proj_bias, norm_eps=config.rms_norm_eps,
        time_step_limit=tuple(getattr(config, "time_step_limit", (0.0, float("inf")))))


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, kind: str, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.is_attention = kind in ATTENTION_KINDS
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_attention:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.self_attn = Attention(index, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, head_dim, dtypes,
                                       bias=getattr(config, "attention_bias", False))
        else:
            self.mamba = bamba_mamba_mixer(config, index, dtypes)
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                     getattr(config, "mlp_bias", False))

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) residual stream; pending: the previous layer's MLP output, not yet added (or
        None). Returns (x, this layer's MLP output): ``x + mlp`` is the next norm's fused residual add."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, pending)
        h = self.self_attn(h, rope, batch) if self.is_attention else self.mamba(h, batch)
        x, h = self.pre_ff_layernorm.add_and_norm(x, h)  # x = x + h, then the norm
        return x, self.feed_forward(h)


class BambaModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        kinds = config.layers_block_type
        self.layers = nn.ModuleList(BambaDecoderLayer(config, i, kinds[i], dtypes)
                                    for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim)


class BambaForCausalLM(RopeDecoderLM):
    final_norm = "final_layernorm"
    fused_residual = True
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = BambaModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
