"""A linear layer over a GGUF file's 4-bit weight (Q4_0, Q4_K), run by the plain-PyTorch reference
``ops/linear_w4.py: linear_w4_ref``. It stands in for the 4-bit kernel layer (``layers/linear_w4.py:
W4Linear``) until that lands; it takes the same ``from_codes`` arguments."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.ops.linear_w4 import linear_w4_ref


class GGUFW4ReferenceLinear(nn.Module):
    """``y = x @ W.T + b`` with W (out, in) in the 4-bit group format of ``ops/linear_w4.py``."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, codes: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, group: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        if tuple(codes.shape) != (out_features, in_features):
            raise ValueError(f"codes {tuple(codes.shape)} do not match ({out_features}, {in_features})")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("mins", mins, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_codes(cls, in_features: int, out_features: int, codes: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor | None, group: int, bias: torch.Tensor | None) -> GGUFW4ReferenceLinear:
        """The layer over ``codes`` (out, in) uint8 0..15, ``scales`` and ``mins`` (out, groups) float32."""
        return cls(in_features, out_features, codes, scales, mins, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features) in x's dtype."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return linear_w4_ref(x, self.codes, self.scales, self.mins, self.group, bias)

    def extra_repr(self) -> str:
        mins = "with mins" if self.mins is not None else "centred"
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit {mins}, group={self.group}"
