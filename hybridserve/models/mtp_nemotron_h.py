"""The MTP head of Nemotron-H (Nemotron-3 Super): checkpoint names ``mtp.layers.{k}.*``.

vLLM's ``nemotron_h_mtp.py`` layout: ``num_nextn_predict_layers`` modules, each a group of blocks whose kinds
``mtp_layers_block_type`` lists (``mtp_hybrid_override_pattern`` in older configs, e.g. ``"*E"``); block ``j``
of module ``s`` is ``mtp.layers.{s * len(kinds) + j}``, a Nemotron-H block (``norm``, ``mixer``: attention
without RoPE, the MoE, or the relu^2 MLP). The first block of a module also holds ``enorm``, ``hnorm`` and
``eh_proj`` (hidden, 2 * hidden); the last holds ``final_layernorm``::

    x = eh_proj(cat([enorm(embed(ids)), hnorm(hidden)]))
    x = blocks(x)                     # x + mixer(norm(x)) each, residual adds fused into the next norm
    return final_layernorm(x)

Mamba blocks are refused (no public MTP checkpoint has one, and vLLM builds none). Attention blocks take
cache indices ``first_layer_index``, ``+ 1``, ... in order; MoE/MLP blocks cache nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.moe import stack_expert_weights
from hybridserve.models.mtp_base import MTPHead
from hybridserve.models.mtp_config import nemotron_h_mtp_block_kinds
from hybridserve.models.nemotron_h import NemotronHBlock, NemotronHLMBase, NemotronHRMSNorm


class NemotronHMTPHead(MTPHead):
    """``num_nextn_predict_layers`` modules of ``len(mtp_layers_block_type)`` Nemotron-H blocks each."""

    def __init__(self, hf_config: Any, target: NemotronHLMBase, dtypes: CacheDtypes, num_layers: int,
                 first_layer_index: int) -> None:
        super().__init__(hf_config, num_layers, first_layer_index)
        config = hf_config
        kinds = nemotron_h_mtp_block_kinds(config)
        self.pattern_len = len(kinds)
        h, eps = config.hidden_size, config.layer_norm_epsilon
        blocks, cache_index = [], first_layer_index
        for _ in range(num_layers):
            for j, kind in enumerate(kinds):
                block = NemotronHBlock(config, cache_index, kind, dtypes)
                if kind == "full_attention":
                    block.layer_index = cache_index
                    cache_index += 1
                if j == 0:
                    block.enorm = NemotronHRMSNorm(h, eps)
                    block.hnorm = NemotronHRMSNorm(h, eps)
                    block.eh_proj = nn.Linear(2 * h, h, bias=False)
                if j == len(kinds) - 1:
                    block.final_layernorm = NemotronHRMSNorm(h, eps)
                blocks.append(block)
        self.layers = nn.ModuleList(blocks)

    def shared_modules(self, target: NemotronHLMBase) -> dict[str, nn.Module]:
        return {"embeddings": target.model.embeddings}

    def transform_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert ``experts.{e}.up_proj/down_proj.weight`` as the target's loader does."""
        return stack_expert_weights(tensors, r".*\.mixer\.experts", {"up_proj": ("up_proj",),
                                                                     "down_proj": ("down_proj",)})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch, step: int = 0) -> torch.Tensor:
        """input_ids (T,), positions (T,) (unused: no RoPE), hidden (T, hidden) -> (T, hidden)."""
        start = self.layer_for(step) * self.pattern_len
        blocks = self.layers[start:start + self.pattern_len]
        first, last = blocks[0], blocks[-1]
        joined = self.concat(first.enorm(self.embeddings(input_ids)), first.hnorm(hidden))  # (T, 2 * hidden)
        x, pending = first.eh_proj(joined), None  # (T, hidden)
        for block in blocks:
            x, pending = block(x, pending, batch)
        return last.final_layernorm.add_and_norm(x, pending)[1]  # (T, hidden)
