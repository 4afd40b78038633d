"""The MTP head of Qwen3-Next and Qwen3.5 (dense, MoE, vision-language): checkpoint names ``mtp.*``.

Per module ``i`` of ``mtp_num_hidden_layers`` (vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` layout)::

    x = fc(cat([pre_fc_norm_embedding(embed(ids)), pre_fc_norm_hidden(hidden)]))   # fc: (hidden, 2 * hidden)
    x = layers[i](x)          # a full-attention decoder layer: gated q, zero-centered q/k norms, partial RoPE,
                              # then the target's MoE (or dense MLP) by Qwen3-Next's rule at index i
    return norm(x)            # every norm zero-centered (weight stored as gamma - 1)

The layers are :class:`~hybridserve.models.qwen3_next.Qwen3NextDecoderLayer` (the target's own class, on its
CPU kernels); the embedding and the rotary embedding are the target's modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.moe import stack_expert_weights
from hybridserve.layers.norms import RMSNorm
from hybridserve.models.mtp_base import MTPHead
from hybridserve.models.qwen3_5 import Qwen3NextView, text_config_of
from hybridserve.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextLMBase


def qwen3_next_config_of(hf_config: Any, target: Qwen3NextLMBase) -> Any:
    """The config as the target's layers read it (Qwen3.5's through the view its class builds)."""
    keys = getattr(target, "qwen3_next_keys", None)
    return hf_config if keys is None else Qwen3NextView(text_config_of(hf_config), **keys)


class Qwen3NextMTPHead(MTPHead):
    """``mtp_num_hidden_layers`` MTP modules sharing the fusing projection and the norms."""

    def __init__(self, hf_config: Any, target: Qwen3NextLMBase, dtypes: CacheDtypes, num_layers: int,
                 first_layer_index: int) -> None:
        super().__init__(hf_config, num_layers, first_layer_index)
        config = qwen3_next_config_of(hf_config, target)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centered=True)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, dtypes, layer_type="full_attention", cache_index=first_layer_index + i)
            for i in range(num_layers))
        for i, layer in enumerate(self.layers):
            layer.layer_index = first_layer_index + i
        self.norm = RMSNorm(h, eps, zero_centered=True)

    def shared_modules(self, target: Qwen3NextLMBase) -> dict[str, nn.Module]:
        return {"embed_tokens": target.model.embed_tokens, "rotary_emb": target.model.rotary_emb}

    def transform_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert weights (fused ``experts.gate_up_proj`` / ``down_proj`` pass through)."""
        return stack_expert_weights(tensors, r".*\.mlp\.experts")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch, step: int = 0) -> torch.Tensor:
        """input_ids (T,), positions (T,), hidden (T, hidden) -> (T, hidden); see :class:`MTPHead`."""
        emb = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))  # (T, hidden)
        x = self.fc(self.concat(emb, self.pre_fc_norm_hidden(hidden)))  # (T, 2 * hidden) -> (T, hidden)
        rope = self.rotary_emb(positions, x.dtype)  # (cos, sin), each (T, rotary_dim)
        x, pending = self.layers[self.layer_for(step)](x, None, rope, batch)
        return self.norm.add_and_norm(x, pending)[1]  # (T, hidden)
