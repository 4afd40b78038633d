"""Feed-forward blocks: gated MLP and a plain (non-gated) MLP."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with separate gate/up projections (HF naming)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` (Nemotron-H uses relu^2 here)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))
