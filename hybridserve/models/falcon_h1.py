"""Falcon-H1 (TII): attention and a Mamba2 mixer side by side in every layer, then a gated MLP.

Each layer caches KV *and* Mamba2 state under one index (merged into an ``attention+mamba2`` spec).
The muP multipliers are folded in exactly where HF applies them: embeddings, attention input and
output, the key projection, the SSM input and output, the five in_proj segments (gate, x, B, C,
dt), the MLP gate and down projections, and the logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.mlp import GatedMLP
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import CausalLM
from hybridserve.ops.attend import paged_attend
from hybridserve.ops.elementwise import add, rotate, scale


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class FalconH1Attention(nn.Module):
    """GQA attention with RoPE whose keys are scaled by ``key_multiplier`` (HF weight names)."""

    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.layer_index = index
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim ** -0.5
        self.key_multiplier = config.key_multiplier
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.spec = LayerCacheSpec(index, "attention", attention=dtypes.attention(self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, Hq, Dh)
        k = scale(self.k_proj(x), self.key_multiplier).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotate(q, rope), rotate(k, rope)
        out = paged_attend(q, k, v, batch, batch.caches[self.layer_index], self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))



class FalconH1MLP(GatedMLP):
    """``down(up(x) * act(gate(x) * m_gate)) * m_down``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act_and_mul(scale(self.gate_proj(x), self.gate_multiplier), self.up_proj(x))
        return scale(self.down_proj(y), self.down_multiplier)


def falcon_h1_mixer(config: Any, index: int, dtypes: CacheDtypes) -> Mamba2Mixer:
    inter = config.mamba_d_ssm if config.mamba_d_ssm is not None else int(config.mamba_expand * config.hidden_size)
    limit = config.time_step_limit if config.time_step_limit is not None else (0.0, float("inf"))
    return Mamba2Mixer(
        index, config.hidden_size, num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
        d_state=config.mamba_d_state, n_groups=config.mamba_n_groups, conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size, dtypes=dtypes, intermediate_size=inter,
        conv_bias=config.mamba_conv_bias, proj_bias=config.mamba_proj_bias, out_proj_bias=config.projectors_bias,
        norm_eps=config.rms_norm_eps, activation=config.hidden_act,
        # HF clamps dt in the chunked scan only; its single-token update does not clamp
        time_step_limit=tuple(limit), decode_time_step_limit=(0.0, float("inf")),
        gated_norm=config.mamba_rms_norm, norm_before_gate=config.mamba_norm_before_gate, norm_in_float32=True,
        proj_multipliers=tuple(config.ssm_multipliers))


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.feed_forward = FalconH1MLP(config)
        self.self_attn = FalconH1Attention(config, index, dtypes)
        self.mamba = falcon_h1_mixer(config, index, dtypes)
        self.ssm_in_multiplier = config.ssm_in_multiplier
        self.ssm_out_multiplier = config.ssm_out_multiplier
        self.attention_in_multiplier = config.attention_in_multiplier
        self.attn_out_multiplier = config.attention_out_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous MLP's output, not yet added (or None). Returns (x, this
        layer's MLP output), each residual add fused into the next norm (the same rounding)."""
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add_and_norm(x, pending)
        m = scale(self.mamba(scale(h, self.ssm_in_multiplier), batch), self.ssm_out_multiplier)
        a = scale(self.self_attn(scale(h, self.attention_in_multiplier), rope, batch), self.attn_out_multiplier)
        x, h = self.pre_ff_layernorm.add_and_norm(x, add(m, a))  # x + (m + a)
        return x, self.feed_forward(h)


class FalconH1Model(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(config, i, dtypes) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        self.embedding_multiplier = config.embedding_multiplier


class FalconH1ForCausalLM(CausalLM):
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = FalconH1Model(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_scale = float(config.lm_head_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids, self.model.embedding_multiplier)  # (T, hidden)
        rope = self.model.rotary_emb(positions, x.dtype)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, rope, batch)
        norm = self.model.final_layernorm
        return norm(x) if pending is None else norm.add_and_norm(x, pending)[1]
