"""Jamba (AI21): Mamba1 layers and attention layers (no positional encoding), each followed by a
gated MLP or a top-k mixture of experts, placed by the config's layer periods and offsets."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba1 import Mamba1Mixer
from hybridserve.layers.mlp import GatedMLP
from hybridserve.layers.moe import FusedExperts, softmax_topk, stack_expert_weights
from hybridserve.layers.norms import RMSNorm
from hybridserve.models.base import CausalLM
from hybridserve.ops.dispatch import call


class JambaSparseMoe(nn.Module):
    """Router (softmax, top-k, weights not renormalized) and fused gated experts (HF names)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # weight (E, H)
        self.router.quantize = False  # a router: its logits pick experts (kept out of int8 weights)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.intermediate_size,
                                    config.hidden_act, gated=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        logits = self.router(x)  # (T, E)
        def plain() -> tuple[torch.Tensor, torch.Tensor]:
            index, weight = softmax_topk(logits, self.top_k, normalize=False)  # (T, k) each
            return index, weight.to(x.dtype)

        routed = call("router_topk", lambda: gemm.router_topk(logits, self.top_k, "softmax_then_topk",
                                                              weight_dtype=x.dtype), plain, logits)
        return self.experts(x, *routed)


class JambaDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.is_attention = config.layers_block_type[index] == "attention"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_attention:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.self_attn = Attention(index, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, head_dim, dtypes)
        else:
            self.mamba = Mamba1Mixer(
                index, config.hidden_size, intermediate_size=int(config.mamba_expand * config.hidden_size),
                d_state=config.mamba_d_state, conv_kernel=config.mamba_d_conv, dt_rank=int(config.mamba_dt_rank),
                dtypes=dtypes, conv_bias=config.mamba_conv_bias, proj_bias=config.mamba_proj_bias,
                activation=config.hidden_act, bcdt_norm="weighted", norm_eps=config.rms_norm_eps)
        if config.layers_num_experts[index] > 1:
            self.feed_forward = JambaSparseMoe(config)
        else:
            self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous feed-forward's output, not yet added (or None). Returns
        (x, this layer's feed-forward output), each residual add fused into the next norm."""
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add_and_norm(x, pending)
        h = self.self_attn(h, None, batch) if self.is_attention else self.mamba(h, batch)
        x, h = self.pre_ff_layernorm.add_and_norm(x, h)
        return x, self.feed_forward(h)


class JambaModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(JambaDecoderLayer(config, i, dtypes) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class JambaForCausalLM(CausalLM):
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = JambaModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def transform_checkpoint(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert ``experts.{e}.gate_proj/up_proj/down_proj.weight`` into the fused
        ``experts.gate_up_proj (E, 2I, H)`` and ``experts.down_proj (E, H, I)``; already fused weights
        pass through unchanged."""
        return stack_expert_weights(weights, r".+\.feed_forward\.experts")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, batch)
        norm = self.model.final_layernorm
        return norm(x) if pending is None else norm.add_and_norm(x, pending)[1]
