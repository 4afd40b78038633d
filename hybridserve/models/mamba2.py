"""Mamba2: a pure SSD model (no attention, so no KV pages at all)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.norms import RMSNorm
from hybridserve.models.base import CausalLM, NormMixerBlock, norm_with_pending


class Mamba2Block(NormMixerBlock):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.residual_in_fp32 = getattr(config, "residual_in_fp32", True)
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(
            index, config.hidden_size, num_heads=config.num_heads, head_dim=config.head_dim,
            d_state=config.state_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size, dtypes=dtypes,
            intermediate_size=int(config.expand * config.hidden_size), conv_bias=config.use_conv_bias,
            proj_bias=config.use_bias, norm_eps=config.layer_norm_epsilon,
            time_step_limit=tuple(config.time_step_limit))



class Mamba2Backbone(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config, i, dtypes) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class Mamba2ForCausalLM(CausalLM):
    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}
    checkpoint_renames = [(r"^backbone\.embedding\.", "backbone.embeddings.")]

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.backbone = Mamba2Backbone(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.backbone.embeddings(input_ids)  # (T, hidden)
        pending = None
        for layer in self.backbone.layers:
            x, pending = layer(x, pending, batch)
        norm = self.backbone.norm_f
        return norm_with_pending(norm, x, pending, self.backbone.layers[-1].residual_in_fp32, final=True)[1]
