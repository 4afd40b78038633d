"""Linear layers over 8-bit weights: int8 made at load (``EngineConfig.quantization="int8"``) or a
checkpoint's fp8 e4m3 weights, each with float32 scales (per output channel, or per group of
in-features), held only in the packed form of the CPU kernel (``kernels/linear_w8.py``). With ``dynamic_activations``
(``quantization="w8a8"``; int8 codes, a scale per output channel) each call quantizes its activations to
int8 per row as well (W8A8)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import fallbacks
from hybridserve.kernels import linear_w8 as kernel
from hybridserve.ops.linear_w8 import linear_w8_ref, linear_w8a8_ref


class W8Linear(nn.Module):
    """``y = x @ (q * s).T + b``: codes q (out, in) of dtype ``fmt`` (int8 or float8_e4m3fn) and scales
    s packed in ``packed_weight`` (uint8); activations bf16, fp16 or float32, the output in their dtype. With
    ``dynamic_activations`` x is quantized to int8 per row first (W8A8: ``ops/linear_w8.py: linear_w8a8_ref``)."""

    def __init__(self, linear: nn.Module, packed_weight: torch.Tensor, fmt: torch.dtype, group: int,
                 dynamic_activations: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", packed_weight, persistent=False)
        self.bias = linear.bias
        self.fmt, self.group = fmt, group
        self.dynamic_activations = dynamic_activations
        if dynamic_activations and (fmt != torch.int8 or group != 0):
            raise ValueError(f"W8A8 takes int8 codes with one scale per output channel, got {fmt} and group={group}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features) in x's dtype."""
        if self.dynamic_activations:
            y = kernel.linear_w8a8(x, self.packed_weight, self.out_features, self.bias)
        else:
            y = kernel.linear(x, self.packed_weight, self.out_features, self.fmt, self.group, self.bias)
        if y is not None:
            return y
        fallbacks.record("linear_w8a8" if self.dynamic_activations else "linear_w8", fallbacks.describe(x))
        q, s = kernel.unpack(self.packed_weight, self.out_features, self.in_features, self.fmt, self.group)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.dynamic_activations:
            return linear_w8a8_ref(x, q, s, bias)
        return linear_w8_ref(x, q, s, self.group, bias)

    def extra_repr(self) -> str:
        fmt = str(self.fmt).removeprefix("torch.")
        w8a8 = ", int8 activations" if self.dynamic_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt}, group={self.group}{w8a8}"
