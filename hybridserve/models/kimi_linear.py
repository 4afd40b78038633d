"""Kimi Linear (Moonshot AI): Kimi delta attention layers (``layers/kda.py``) and multi-head latent
attention layers without positional encoding (``layers/mla.py``), each followed by a dense SwiGLU MLP
(the first ``first_k_dense_replace`` layers, HF's ``mlp_layer_types``) or a DeepSeek-V3-style MoE: sigmoid
router with a correction bias over expert groups (Nemotron-H's router), fused SwiGLU experts, and a
shared SwiGLU expert added after them.

Caches: per KDA layer a conv window (``mamba_cache_dtype``) and a (heads, head_dim, head_dim) recurrent
state (``mamba_ssm_cache_dtype``); per MLA layer one latent of ``kv_lora_rank + qk_rope_head_dim`` per
token (``kv_cache_dtype``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.kda import KimiDeltaAttention
from hybridserve.layers.mla import LatentAttention
from hybridserve.layers.mlp import GatedMLP
from hybridserve.layers.moe import FusedExperts, stack_expert_weights
from hybridserve.layers.norms import RMSNorm
from hybridserve.models.base import CausalLM
from hybridserve.models.nemotron_h import NemotronHTopkRouter

LAYER_KINDS = ("linear_attention", "full_attention")


class KimiLinearRouter(NemotronHTopkRouter):
    """HF's ``KimiLinearTopkRouter``: the same routing as Nemotron-H's (sigmoid scores, choice by score +
    ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups, chosen scores
    normalized over their sum + 1e-20, times ``routed_scaling_factor``); Kimi's config names."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_local_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} is not a multiple of n_group={self.n_group}")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        # A persistent buffer in HF; a (frozen) parameter here so the strict loader loads it.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)


class KimiLinearMoE(nn.Module):
    """Router (``gate``), fused SwiGLU experts, ``shared_experts`` (HF names)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = KimiLinearRouter(config)
        self.experts = FusedExperts(config.num_local_experts, config.hidden_size, config.moe_intermediate_size,
                                    config.hidden_act)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                       config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden): the experts' sum, rounded, plus the shared expert's output."""
        index, weight = self.gate(x)
        return self.experts(x, index, weight, self.shared_experts(x))


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.kind = config.layer_types[index]
        if self.kind == "linear_attention":
            self.self_attn = KimiDeltaAttention(
                index, config.hidden_size, num_heads=config.linear_num_heads, head_dim=config.linear_head_dim,
                conv_kernel=config.linear_conv_kernel_dim, dtypes=dtypes, norm_eps=config.rms_norm_eps,
                activation=config.hidden_act)
        elif self.kind == "full_attention":
            self.self_attn = LatentAttention(
                index, config.hidden_size, num_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                v_head_dim=config.v_head_dim, dtypes=dtypes, q_lora_rank=config.q_lora_rank,
                bias=config.attention_bias)
        else:
            raise ValueError(f"layer {index}: layer type {self.kind!r} is not supported by Kimi Linear; "
                             f"supported: {', '.join(LAYER_KINDS)}")
        mlp_kind = config.mlp_layer_types[index]
        if mlp_kind not in ("dense", "sparse"):
            raise ValueError(f"layer {index}: mlp layer type {mlp_kind!r} is not supported; supported: dense, sparse")
        self.mlp = KimiLinearMoE(config) if mlp_kind == "sparse" else GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous MLP's output, not yet added (or None). Returns (x, this
        layer's MLP output), each residual add fused into the next norm (the same rounding)."""
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add_and_norm(x, pending)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, batch))
        return x, self.mlp(h)


class KimiLinearModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiLinearDecoderLayer(config, i, dtypes)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KimiLinearForCausalLM(CausalLM):
    # HF never ties Kimi Linear's LM head to the embeddings (its ``_tied_weights_keys`` is empty).
    tied_weights: dict[str, str] = {}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = KimiLinearModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: (T,) -> (T, hidden); no positional encoding (positions unused)."""
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, batch)
        return self.model.norm(x) if pending is None else self.model.norm.add_and_norm(x, pending)[1]

    #: the published layout (also what HF's save_pretrained writes), as HF's conversion mapping reads it
    checkpoint_renames = [(r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b", r".self_attn.forget_gate.\1"),
                          (r"\.block_sparse_moe\.", ".mlp.")]
    #: published per-expert SwiGLU names: w1 (gate), w3 (up), w2 (down)
    expert_projections = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

    def transform_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Concatenate each KDA layer's ``q_conv1d``/``k_conv1d``/``v_conv1d`` into ``conv1d`` (channels
        ``[q | k | v]``) and stack the per-expert ``w1``/``w3``/``w2`` into the fused experts."""
        out: dict[str, torch.Tensor] = {}
        convs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            m = re.match(r"^(?P<prefix>.+\.self_attn)\.(?P<part>[qkv])_conv1d\.weight$", name)
            if m is None:
                out[name] = tensor
            else:
                convs.setdefault(m["prefix"], {})[m["part"]] = tensor
        for prefix, parts in convs.items():
            missing = [f"{prefix}.{p}_conv1d.weight" for p in "qkv" if p not in parts]
            if missing:
                raise ValueError(f"checkpoint lacks conv weights {missing}")
            out[f"{prefix}.conv1d.weight"] = torch.cat([parts[p] for p in "qkv"], dim=0)  # (3 H D, 1, K)
        return stack_expert_weights(out, r".*\.mlp\.experts", self.expert_projections)
