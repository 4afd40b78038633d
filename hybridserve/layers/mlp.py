"""Feed-forward blocks: gated MLP and a plain (non-gated) MLP."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.layers.activations import activation
from hybridserve.ops.dispatch import call, declined

ACT_MUL_KERNELS = {"silu": "silu_mul", "gelu": "gelu_mul"}  # activation -> its kernel in kernels/pointwise.py


class ActAndMul(nn.Module):
    """``act(gate) * up``, each op rounded to the activation dtype as in PyTorch (silu and gelu have CPU kernels)."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = act
        self.act_fn = activation(act)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: (T, I) -> (T, I)."""
        kernel = ACT_MUL_KERNELS.get(self.act)
        if kernel is None:
            declined("act_and_mul", f"{self.act}: no kernel")
            return self.act_fn(gate) * up
        return call("act_and_mul", lambda: getattr(pointwise_kernels, kernel)(gate, up),
                    lambda: self.act_fn(gate) * up, gate, up)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with separate gate/up projections (HF naming)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_and_mul = ActAndMul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` (Nemotron-H uses relu^2 here, which has a CPU kernel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act, self.act_fn = act, activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if self.act != "relu2":
            declined("activation", f"{self.act}: no kernel")
            return self.down_proj(self.act_fn(h))
        return self.down_proj(call("activation", lambda: pointwise_kernels.relu2(h), lambda: self.act_fn(h), h))
