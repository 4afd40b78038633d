"""MiniMax (MiniMax-Text-01): lightning (linear) attention and softmax attention layers, each
followed by a sparse MoE, with alpha/beta-weighted residuals around the *normalized* hidden state.

Layer kinds come from ``config.layer_types`` (``linear_attention`` / ``full_attention``). A lightning
layer keeps one recurrent KV state per sequence, ``kv_state (heads, head_dim, head_dim)``, a temporal
state (follows ``mamba_ssm_cache_dtype``). Its per-head decay rate depends on the layer index:
``s_h = (2^(-8/H))^(h+1) * (1 - i/(L-1+1e-5) + 1e-5)``, so the last layer barely forgets.

Checkpoints (what HF ``save_pretrained`` writes, and the published ones) keep Mixtral-style experts,
``block_sparse_moe.experts.{e}.w1/w2/w3.weight``; they are stacked into the fused ``mlp.experts``
weights on load. The decay buffers HF persists (``slope_rate``, ``*_decay``) are recomputed instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.layers.activations import activation
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.moe import FusedExperts, softmax_topk, stack_expert_weights
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.layers.state_shapes import linear_attention_spec
from hybridserve.models.base import RopeDecoderLM
from hybridserve.ops.dispatch import call
from hybridserve.ops.elementwise import scaled_sum
from hybridserve.ops.lightning_attention import lightning_attention_mix

LINEAR_KINDS = ("linear_attention",)
DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def slope_rates(num_heads: int, layer_index: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates (H,) float32, computed as HF's ``get_slope_rate``."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(num_heads, device="cpu") + 1
    factor = 1 - layer_index / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** exponent * factor).float()


class LightningAttention(nn.Module):
    """MiniMax linear attention: ``act(qkv_proj)`` -> decayed linear attention -> RMS norm ->
    ``sigmoid(output_gate(x))`` gate -> ``out_proj`` (HF weight names)."""

    def __init__(self, config: Any, layer_index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.head_dim = config.num_attention_heads, head_dim_of(config)
        self.num_layers = config.num_hidden_layers
        self.block_size = config.block_size
        inner = self.num_heads * self.head_dim
        self.act, self.act_fn = config.hidden_act, activation(config.hidden_act)
        self.norm = RMSNorm(inner)  # HF uses the default eps (1e-6) here, not rms_norm_eps
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * inner, bias=False)
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.output_gate = nn.Linear(config.hidden_size, inner, bias=False)
        self.register_buffer("slope_rate", slope_rates(self.num_heads, layer_index, self.num_layers),
                             persistent=False)
        self.spec = linear_attention_spec(layer_index, dtypes, num_heads=self.num_heads, head_dim=self.head_dim)

    def reset_buffers(self) -> None:
        """Recompute the float32 decay rates on the module's device (after meta construction)."""
        rate = slope_rates(self.num_heads, self.layer_index, self.num_layers)
        self.slope_rate = rate.to(self.slope_rate.device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        states = batch.caches[self.layer_index].state["kv_state"]  # (slots, H, D, D)
        y = lightning_attention_mix(self, self.qkv_proj(x), self.output_gate(x), batch, states, x.dtype)
        return self.out_proj(y)  # (T, hidden)


class MiniMaxSparseMoeBlock(nn.Module):
    """Softmax top-k router (renormalized weights) over gated experts."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.gate.quantize = False  # a router: its logits pick experts (kept out of int8 weights)
        self.experts = FusedExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                    config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # (T, E)
        routed = call("router_topk", lambda: gemm.router_topk(logits, self.top_k, "softmax_then_topk", normalize=True),
                      lambda: softmax_topk(logits, self.top_k, normalize=True), logits)  # (T, k) each
        return self.experts(x, *routed)


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        kind = config.layer_types[index]
        self.is_linear = kind in LINEAR_KINDS
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            self.self_attn = LightningAttention(config, index, dtypes)
            self.attn_alpha, self.attn_beta = config.linear_attn_alpha_factor, config.linear_attn_beta_factor
        else:
            self.self_attn = Attention(index, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, head_dim_of(config), dtypes,
                                       sliding_window=getattr(config, "sliding_window", None))
            self.attn_alpha, self.attn_beta = config.full_attn_alpha_factor, config.full_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha_factor, config.mlp_beta_factor
        self.mlp = MiniMaxSparseMoeBlock(config)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(x)  # the residual branch is the normalized input, as in HF
        a = self.self_attn(h, batch) if self.is_linear else self.self_attn(h, rope, batch)
        h = self.post_attention_layernorm(scaled_sum(h, self.attn_alpha, a, self.attn_beta))
        return scaled_sum(h, self.mlp_alpha, self.mlp(h), self.mlp_beta)


class MiniMaxModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiniMaxDecoderLayer(config, i, dtypes) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))


class MiniMaxForCausalLM(RopeDecoderLM):
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    checkpoint_renames = [(r"\.block_sparse_moe\.", ".mlp.")]

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = MiniMaxModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def transform_checkpoint(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert ``experts.{e}.w1/w3`` into ``gate_up_proj (E, 2I, H)`` and ``w2`` into
        ``down_proj (E, H, I)``; drop the derived decay buffers of lightning layers."""
        kept = {n: t for n, t in weights.items() if not (n.endswith(DECAY_BUFFERS) and ".self_attn." in n)}
        return stack_expert_weights(kept, r".*\.experts", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)})
