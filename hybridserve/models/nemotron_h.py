"""Nemotron-H (NVIDIA): every layer is ``x + mixer(norm(x))`` with one mixer of four kinds.

Kinds (transformers' names, legacy names accepted): ``linear_attention`` (``mamba``, "M") a Mamba2 mixer,
``full_attention`` (``attention``, "*") attention without positional encoding (no RoPE), ``mlp`` ("-") a
non-gated relu^2 MLP, ``moe`` ("E") a DeepSeek-V3-style router (sigmoid scores, correction bias, expert
groups) over non-gated experts plus a shared expert, optionally through a latent projection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.mlp import PlainMLP
from hybridserve.layers.moe import FusedExperts, stack_expert_weights
from hybridserve.layers.norms import RMSNorm
from hybridserve.models.base import CausalLM
from hybridserve.ops.dispatch import call
from hybridserve.ops.elementwise import add

KIND_ALIASES = {"mamba": "linear_attention", "attention": "full_attention"}
KINDS = ("linear_attention", "full_attention", "mlp", "moe")


class NemotronHRMSNorm(RMSNorm):
    """RMS norm whose weight multiply stays in float32; only the product is cast back (as HF does)."""

    weight_in_float32 = True

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class NemotronHTopkRouter(nn.Module):
    """Sigmoid scores; choice by score + ``e_score_correction_bias`` within the ``topk_group`` best of
    ``n_group`` expert groups (a group's score is the sum of its two best); the weights are the chosen
    plain scores, optionally normalized, times ``routed_scaling_factor``. All in float32."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        if self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} is not a multiple of n_group={self.n_group}")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        # A persistent buffer in HF; a (frozen) parameter here so the strict loader loads it.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> topk_index (T, k), topk_weight (T, k) float32."""
        return call("router_grouped_sigmoid", lambda: self._forward_kernels(x),
                    lambda: self._forward_plain(x), x, self.weight)

    def _forward_plain(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch body."""
        t = x.shape[0]
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(t, self.n_group, self.num_experts // self.n_group)  # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]  # (T, topk_group)
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()  # (T, G)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, self.num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        index = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # (T, k)
        weight = scores.gather(1, index)
        if self.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weight * self.routed_scaling_factor


    def _forward_kernels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (self.weight.data_ptr(), self.e_score_correction_bias.data_ptr())
        if getattr(self, "_float32_key", None) != key:  # float32 copies, made once
            self._weight32 = self.weight.detach().float().contiguous()
            self._bias32 = self.e_score_correction_bias.detach().float().contiguous()
            self._float32_key = key
        logits = gemm.linear_f32(x, self._weight32)  # (T, E) float32
        if logits is None:
            return None
        return gemm.router_grouped_sigmoid(logits, self._bias32, self.top_k, self.n_group, self.topk_group,
                                           self.norm_topk_prob, self.routed_scaling_factor)


class NemotronHMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        latent = getattr(config, "moe_latent_size", None)
        self.gate = NemotronHTopkRouter(config)
        self.experts = FusedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                    config.mlp_hidden_act, gated=False, input_size=latent)
        self.shared_experts = PlainMLP(config.hidden_size, config.moe_shared_expert_intermediate_size,
                                       config.mlp_hidden_act, config.mlp_bias)
        self.has_latent = latent is not None
        if self.has_latent:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, latent, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        index, weight = self.gate(x)
        shared = self.shared_experts(x)
        if not self.has_latent:
            return self.experts(x, index, weight, shared)  # experts + shared, rounded as experts(x) + shared
        h = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), index, weight))  # through the latent
        return add(h, shared)


def _mixer(config: Any, index: int, kind: str, dtypes: CacheDtypes) -> nn.Module:
    if kind == "linear_attention":
        return Mamba2Mixer(
            index, config.hidden_size, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
            d_state=config.ssm_state_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size, dtypes=dtypes,
            intermediate_size=config.mamba_num_heads * config.mamba_head_dim, conv_bias=config.use_conv_bias,
            proj_bias=config.use_bias, norm_eps=config.layer_norm_epsilon,
            # HF: the scan clamps dt below at time_step_min; the recurrent step does not clamp.
            time_step_limit=(float(config.time_step_min), float("inf")), activation=config.mamba_hidden_act,
            decode_time_step_limit=(0.0, float("inf")))
    if kind == "full_attention":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return Attention(index, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         head_dim, dtypes, bias=False)
    if kind == "mlp":
        return PlainMLP(config.hidden_size, config.intermediate_size, config.mlp_hidden_act, config.mlp_bias)
    return NemotronHMoE(config)


class NemotronHBlock(nn.Module):
    def __init__(self, config: Any, index: int, kind: str, dtypes: CacheDtypes) -> None:
        super().__init__()
        kind = KIND_ALIASES.get(kind, kind)
        if kind not in KINDS:
            raise ValueError(f"layer {index}: unknown Nemotron-H layer kind {kind!r}; known: {', '.join(KINDS)}")
        self.kind = kind
        self.norm = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = _mixer(config, index, kind, dtypes)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous mixer's output, not yet added (or None). Returns (x,
        this mixer's output), ``x + h`` fused into the next norm (the same rounding)."""
        x, h = (x, self.norm(x)) if pending is None else self.norm.add_and_norm(x, pending)
        if self.kind == "linear_attention":
            h = self.mixer(h, batch)
        elif self.kind == "full_attention":
            h = self.mixer(h, None, batch)  # no positional encoding
        else:
            h = self.mixer(h)
        return x, h


class NemotronHModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embeddings = Embedding(config.vocab_size, config.hidden_size)
        kinds = config.layers_block_type
        self.layers = nn.ModuleList(NemotronHBlock(config, i, kinds[i], dtypes) for i in range(len(kinds)))
        self.norm_f = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon)


class NemotronHLMBase(CausalLM):
    # HF never ties Nemotron-H's LM head to the embeddings (its ``_tied_weights_keys`` is empty).
    tied_weights: dict[str, str] = {}
    checkpoint_renames = [(r"^backbone\.", "model.")]

    def transform_checkpoint(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert ``experts.{e}.up_proj/down_proj.weight`` (the published layout, also what HF's
        save_pretrained writes) into ``experts.up_proj (E, I, H)`` / ``experts.down_proj (E, H, I)``; drop the
        multi-token-prediction ``mtp.*`` weights, which HF ignores as well."""
        return stack_expert_weights({n: t for n, t in weights.items() if not n.startswith("mtp.")},
                                    r".*\.mixer\.experts", {"up_proj": ("up_proj",), "down_proj": ("down_proj",)})

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = NemotronHModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embeddings(input_ids)  # (T, hidden)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, batch)
        return self.model.norm_f(x) if pending is None else self.model.norm_f.add_and_norm(x, pending)[1]


class NemotronHForCausalLM(NemotronHLMBase):
    """Nemotron-H (HF weight names)."""
