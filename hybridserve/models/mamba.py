"""Mamba (Mamba1): a pure selective-scan model (no attention, so no KV pages at all)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba1 import Mamba1Mixer
from hybridserve.layers.norms import RMSNorm
from hybridserve.models.base import CausalLM, NormMixerBlock, norm_with_pending


class MambaBlock(NormMixerBlock):
    """``residual + mixer(norm(x))``, the residual kept in float32 when the config says so."""

    def __init__(self, config: Any, index: int, dtypes: CacheDtypes, bcdt_norm: str | None,
                 norm_eps: float) -> None:
        super().__init__()
        self.residual_in_fp32 = getattr(config, "residual_in_fp32", True)
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = Mamba1Mixer(
            index, config.hidden_size, intermediate_size=config.intermediate_size, d_state=config.state_size,
            conv_kernel=config.conv_kernel, dt_rank=int(config.time_step_rank), dtypes=dtypes,
            conv_bias=config.use_conv_bias, proj_bias=config.use_bias, activation=config.hidden_act,
            bcdt_norm=bcdt_norm, norm_eps=norm_eps)



class MambaBackbone(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes, bcdt_norm: str | None, norm_eps: float) -> None:
        super().__init__()
        self.embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, i, dtypes, bcdt_norm, norm_eps)
                                    for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class MambaLMBase(CausalLM):
    """The Mamba1 language model, shared by the Mamba and FalconMamba families."""

    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}
    checkpoint_renames = [(r"^backbone\.embedding\.", "backbone.embeddings.")]
    #: the mixer's norms on dt, B and C (see ``Mamba1Mixer``); Mamba has none
    bcdt_norm: str | None = None

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        eps = float(getattr(config, "mixer_rms_eps", 1e-6))
        self.backbone = MambaBackbone(config, dtypes, self.bcdt_norm, eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.backbone.embeddings(input_ids)  # (T, hidden)
        pending = None
        for layer in self.backbone.layers:
            x, pending = layer(x, pending, batch)
        norm = self.backbone.norm_f
        return norm_with_pending(norm, x, pending, self.backbone.layers[-1].residual_in_fp32, final=True)[1]


class MambaForCausalLM(MambaLMBase):
    """Mamba1 (HF weight names), no norms on dt, B and C."""
