"""LFM2-MoE (Liquid AI): LFM2's short-conv and attention layers; the first ``num_dense_layers`` layers
keep a SwiGLU MLP, the others a mixture of experts.

The router is HF's ``Lfm2MoeTopKRouter``: ``sigmoid(gate(x))`` scores; experts are chosen by the top-k
of ``scores + expert_bias`` (a float32 buffer in HF, kept in float32 here) when ``use_expert_bias``, else
of the scores; the chosen scores are the weights, divided by their sum (+1e-6) when ``norm_topk_prob`` and
scaled by ``routed_scaling_factor``. The caches are LFM2's: a conv window per short-conv layer (a conv
state, ``mamba_cache_dtype``), KV per attention layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.kernels import gemm
from hybridserve.layers.moe import FusedExperts, stack_expert_weights
from hybridserve.models.lfm2 import Lfm2LMBase, Lfm2MLP, Lfm2Model
from hybridserve.ops.dispatch import call


class Lfm2MoeRouter(nn.Module):
    """``gate.weight (E, hidden)``: (T, hidden) -> expert index (T, k), weight (T, k) float32, in float32
    (HF computes the scores in the model dtype; float32 is exact for a float32 model and closer to HF's
    float32 reference for a 16-bit one). On the CPU kernels it is the grouped-sigmoid router with one group."""

    #: HF's renormalization: the chosen scores over their sum + this
    NORM_EPS = 1e-6

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.scaling = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); expert_bias: (E,) float32 or None."""
        return call("router_grouped_sigmoid", lambda: self._forward_kernels(x, expert_bias),
                    lambda: self._forward_plain(x, expert_bias), x, self.weight)

    def _forward_plain(self, x: torch.Tensor, expert_bias: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch body."""
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        choice = scores if expert_bias is None else scores + expert_bias
        index = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # (T, k)
        weight = scores.gather(1, index)
        if self.norm_topk_prob:
            weight = weight / (weight.sum(-1, keepdim=True) + self.NORM_EPS)
        return index, weight * self.scaling

    def _forward_kernels(self, x: torch.Tensor, expert_bias: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (self.weight.data_ptr(), None if expert_bias is None else expert_bias.data_ptr())
        if getattr(self, "_float32_key", None) != key:  # float32 copies, made once
            self._weight32 = self.weight.detach().float().contiguous()
            self._bias32 = (torch.zeros(self.weight.shape[0]) if expert_bias is None
                            else expert_bias.detach().float().contiguous())
            self._float32_key = key
        logits = gemm.linear_f32(x, self._weight32)  # (T, E) float32
        if logits is None:
            return None
        return gemm.router_grouped_sigmoid(logits, self._bias32, self.top_k, 1, 1, self.norm_topk_prob,
                                           self.scaling, self.NORM_EPS)


class Lfm2MoeSparseMoeBlock(nn.Module):
    """Router (``gate``), ``expert_bias`` and fused SwiGLU experts (HF names)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = Lfm2MoeRouter(config)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, "silu")
        self.expert_bias = (nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
                            if config.use_expert_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        index, weight = self.gate(x, self.expert_bias)
        return self.experts(x, index, weight)


def _feed_forward(config: Any, index: int) -> nn.Module:
    if index < config.num_dense_layers:
        return Lfm2MLP(config, config.intermediate_size)
    return Lfm2MoeSparseMoeBlock(config)


class Lfm2MoeForCausalLM(Lfm2LMBase):
    #: checkpoints store each expert's SwiGLU as w1 (gate), w3 (up) and w2 (down)
    expert_projections = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config, dtypes)
        self.model = Lfm2Model(config, dtypes, _feed_forward)

    def transform_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert weights into the fused experts."""
        return stack_expert_weights(tensors, r".*\.feed_forward\.experts", self.expert_projections)
