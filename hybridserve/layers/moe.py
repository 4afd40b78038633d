"""Mixture-of-experts building blocks with HF 5's fused expert weights.

Experts are stored as 3-D parameters (HF names): gated experts ``gate_up_proj (E, 2I, H)`` and
``down_proj (E, H, I)``; non-gated experts ``up_proj (E, I, H)`` and ``down_proj (E, H, I)``.
Routers differ per family and live with their model; they produce ``(topk_index, topk_weight)``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


def softmax_topk(router_logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax over experts. router_logits: (T, E) -> index (T, k), weight (T, k) float32."""
    probs = router_logits.float().softmax(-1)  # (T, E)
    weight, index = probs.topk(k, dim=-1)
    if normalize:
        weight = weight / weight.sum(-1, keepdim=True)
    return index, weight


class FusedExperts(nn.Module):
    """E experts applied to the tokens routed to them, weighted and summed per token."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str, gated: bool = True,
                 input_size: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.gated = num_experts, gated
        d_in = input_size or hidden_size
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, d_in))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, d_in))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_in, intermediate_size))
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor, topk_index: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x: (T, H); topk_index, topk_weight: (T, k) -> (T, H) in x's dtype."""
        out = torch.zeros(x.shape[0], self.down_proj.shape[1], dtype=torch.float32, device=x.device)
        flat_expert = topk_index.reshape(-1)  # (T*k,)
        order = flat_expert.argsort(stable=True)
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        token_of = (order // topk_index.shape[1])  # (T*k,) token of each sorted assignment
        weight_of = topk_weight.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            h = x[rows]  # (n, H)
            if self.gated:
                gate, up = nn.functional.linear(h, self.gate_up_proj[e]).chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            else:
                h = self.act_fn(nn.functional.linear(h, self.up_proj[e]))
            h = nn.functional.linear(h, self.down_proj[e])  # (n, H)
            out.index_add_(0, rows, h.float() * weight_of[start:start + n, None].float())
            start += n
        return out.to(x.dtype)
