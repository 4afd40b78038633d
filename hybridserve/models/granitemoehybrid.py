"""Granite-4.0-H (GraniteMoeHybrid, IBM): Mamba2 and attention layers, each followed by a MoE with a
shared MLP (or by the shared MLP alone when ``num_local_experts == 0``, the dense variant).

Granite's multipliers, where HF applies them:
* ``embedding_multiplier``: the token embeddings are multiplied by it;
* ``attention_multiplier``: the attention softmax scale (replaces ``head_dim ** -0.5``);
* ``residual_multiplier``: each mixer's and each MLP's output before it joins the residual;
* ``logits_scaling``: the logits are divided by it.
Positions: RoPE only when ``position_embedding_type == "rope"``, otherwise none (Granite-4.0-H is NoPE).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.layers import dense
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.mlp import ActAndMul
from hybridserve.layers.moe import FusedExperts
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import CausalLM
from hybridserve.ops.dispatch import call

MAMBA_KINDS = ("linear_attention", "mamba")


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class GraniteMoeHybridMLP(nn.Module):
    """The shared MLP: ``output_linear(act(a) * b)`` where ``input_linear(x) = [a, b]``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.input_linear = nn.Linear(config.hidden_size, 2 * config.shared_intermediate_size, bias=False)
        self.output_linear = nn.Linear(config.shared_intermediate_size, config.hidden_size, bias=False)
        self.act_and_mul = ActAndMul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)  # (T, I) each
        return self.output_linear(self.act_and_mul(gate, up))


class GraniteMoeHybridRouter(nn.Module):
    """Top-k of the router logits, then a softmax over the k chosen (HF ``GraniteMoeHybridTopKRouter``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> topk_index (T, k), topk_weight (T, k) in x's dtype."""
        return call("router_topk", lambda: self._forward_kernels(x),
                    lambda: self._forward_plain(x), x, self.weight)

    def _forward_plain(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch body."""
        logits = dense.linear(x, self.weight).float()  # (T, E)
        top_logits, index = logits.topk(self.top_k, dim=-1)
        return index, top_logits.softmax(-1).to(x.dtype)


    def _forward_kernels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logits as ``dense.linear`` gives them (float32 sums of the float32 weight, rounded to x's
        dtype), then top-k and the softmax over it."""
        if getattr(self, "_weight32_key", None) != self.weight.data_ptr():  # a float32 copy, made once
            self._weight32 = self.weight.detach().float().contiguous()
            self._weight32_key = self.weight.data_ptr()
        logits = gemm.linear_f32(x, self._weight32, x.dtype)  # (T, E)
        return None if logits is None else gemm.router_topk(logits, self.top_k, "topk_then_softmax",
                                                            weight_dtype=x.dtype)


class GraniteMoeHybridMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.router = GraniteMoeHybridRouter(config)
        self.experts = FusedExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                    config.hidden_act, gated=True)

    def forward(self, x: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, hidden) -> the experts' output, plus ``shared`` (the shared MLP's) when given."""
        index, weight = self.router(x)
        return self.experts(x, index, weight, shared)


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, kind: str, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.is_mamba = kind in MAMBA_KINDS
        self.residual_multiplier = float(config.residual_multiplier)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                index, config.hidden_size, num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
                d_state=config.mamba_d_state, n_groups=config.mamba_n_groups, conv_kernel=config.mamba_d_conv,
                chunk_size=config.mamba_chunk_size, dtypes=dtypes,
                intermediate_size=int(config.mamba_expand * config.hidden_size), conv_bias=config.mamba_conv_bias,
                proj_bias=config.mamba_proj_bias, norm_eps=config.rms_norm_eps,
                time_step_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
                activation=config.hidden_act,
                decode_time_step_limit=(0.0, float("inf")))  # HF's recurrent step does not clamp dt
        else:
            self.self_attn = Attention(index, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, head_dim_of(config), dtypes,
                                       bias=config.attention_bias, scale=float(config.attention_multiplier))
        self.has_experts = (config.num_local_experts or 0) > 0
        if self.has_experts:
            self.block_sparse_moe = GraniteMoeHybridMoE(config)
        self.shared_mlp = GraniteMoeHybridMLP(config)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) residual stream; pending: the previous layer's MLP output, not yet added (or
        None). Returns (x, this layer's MLP output): adding it is fused into the next norm."""
        rm = self.residual_multiplier
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, pending, rm)
        h = self.mamba(h, batch) if self.is_mamba else self.self_attn(h, rope, batch)
        x, h = self.post_attention_layernorm.add_and_norm(x, h, rm)
        mlp = self.shared_mlp(h)
        if self.has_experts:
            mlp = self.block_sparse_moe(h, mlp)  # experts + shared, rounded as block_sparse_moe(h) + mlp
        return x, mlp


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        kinds = config.layers_block_type
        self.layers = nn.ModuleList(GraniteMoeHybridDecoderLayer(config, i, kinds[i], dtypes)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.rotary_emb = (RotaryEmbedding(config, head_dim_of(config))
                           if config.position_embedding_type == "rope" else None)


class GraniteMoeHybridForCausalLM(CausalLM):
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    # Published checkpoints (and HF's save_pretrained) use the GraniteMoe names; the layouts are the same.
    checkpoint_renames = [
        (r"\.block_sparse_moe\.input_linear\.weight$", ".block_sparse_moe.experts.gate_up_proj"),  # (E, 2I, H)
        (r"\.block_sparse_moe\.output_linear\.weight$", ".block_sparse_moe.experts.down_proj"),  # (E, H, I)
        (r"\.block_sparse_moe\.router\.layer\.weight$", ".block_sparse_moe.router.weight"),
    ]

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = GraniteMoeHybridModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_scaling = float(config.logits_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids, self.model.embedding_multiplier)  # (T, hidden)
        rope = self.model.rotary_emb(positions, x.dtype) if self.model.rotary_emb is not None else None
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, rope, batch)
        if pending is None:
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, pending, self.model.layers[-1].residual_multiplier)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> logits (N, vocab) float32, divided by ``logits_scaling`` as HF does."""
        return self.sampling_logits(hidden).float()

    def sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in the model dtype, divided by ``logits_scaling`` there (HF's order)."""
        logits = self.lm_head(hidden)  # (N, vocab)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits
