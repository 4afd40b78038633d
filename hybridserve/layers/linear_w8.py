"""Linear layers over 8-bit weights: int8 made at load (``EngineConfig.quantization="int8"``) or a
checkpoint's fp8 e4m3 weights, each with float32 scales (per output channel, or per group of
in-features), held only in the packed form of the CPU kernel (``kernels/linear_w8.py``)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import fallbacks
from hybridserve.kernels import linear_w8 as kernel
from hybridserve.ops.linear_w8 import linear_w8_ref


class W8Linear(nn.Module):
    """``y = x @ (q * s).T + b``: codes q (out, in) of dtype ``fmt`` (int8 or float8_e4m3fn) and scales
    s packed in ``packed_weight`` (uint8); activations bf16, fp16 or float32, the output in their dtype."""

    def __init__(self, linear: nn.Module, packed_weight: torch.Tensor, fmt: torch.dtype, group: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", packed_weight, persistent=False)
        self.bias = linear.bias
        self.fmt, self.group = fmt, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features) in x's dtype."""
        y = kernel.linear(x, self.packed_weight, self.out_features, self.fmt, self.group, self.bias)
        if y is not None:
            return y
        fallbacks.record("linear_w8", fallbacks.describe(x))
        q, s = kernel.unpack(self.packed_weight, self.out_features, self.in_features, self.fmt, self.group)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return linear_w8_ref(x, q, s, self.group, bias)

    def extra_repr(self) -> str:
        fmt = str(self.fmt).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt}, group={self.group}"
