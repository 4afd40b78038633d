"""Linear layers over GGUF Q6_K weights (``ops/linear_w6k.py``'s format), held only in the packed form of the CPU
kernel (``kernels/linear_w6k.py``): made at load from a file's Q6_K blocks (a linear, an untied ``output.weight``,
or the LM head a tied Q6_K ``token_embd`` gives)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import fallbacks
from hybridserve.kernels import linear_w6k as kernel
from hybridserve.ops.linear_w6k import linear_w6k_ref


class W6KLinear(nn.Module):
    """``y = x @ dequantize_w6k(codes, sub_scales, super_scales).T + b`` over the packed buffer ``packed_weight``;
    activations bf16, fp16 or float32, the output in their dtype."""

    packed_weight: torch.Tensor

    def __init__(self, in_features: int, out_features: int, packed_weight: torch.Tensor,
                 bias: torch.Tensor | nn.Parameter | None) -> None:
        super().__init__()
        expected = kernel.packed_bytes(out_features, in_features)
        if packed_weight.dtype != torch.uint8 or packed_weight.numel() != expected:
            raise ValueError(f"a packed ({out_features}, {in_features}) Q6_K weight is {expected} uint8 bytes, "
                             f"got {packed_weight.dtype} {tuple(packed_weight.shape)}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed_weight", packed_weight, persistent=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> W6KLinear:
        """A layer over codes (out_features, in_features) uint8 0..63, int8 sub-scales per 16 in-features and
        float16-valued super-scales per 256. Raises ValueError naming an operand outside the format (in-features
        not a multiple of 256 among them)."""
        packed = kernel.pack(codes, sub_scales, super_scales)
        return cls(codes.shape[1], codes.shape[0], packed, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features) in x's dtype."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = kernel.linear(x, self.packed_weight, self.out_features, bias)
        if y is not None:
            return y
        fallbacks.record("linear_w6k", fallbacks.describe(x) + f", K={self.in_features}")
        return linear_w6k_ref(x, *self.unpacked(), bias)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes, sub-scales and super-scales the layer holds."""
        return kernel.unpack(self.packed_weight, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q6_k"
