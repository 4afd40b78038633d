"""RMS norms (computed in float32, as HF does)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.ops.dispatch import call


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; the normalization runs in float32, the result is cast back first."""

    weight_in_float32 = False  # the weight multiplies the float32 normalized value (a subclass's rounding)

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.zero_centered = zero_centered  # weight stored as (gamma - 1), as in Qwen3-Next

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return call("rms_norm", lambda: pointwise_kernels.rms_norm(x, self.weight, self.eps, self.zero_centered,
                                                                   weight_in_float32=self.weight_in_float32),
                    lambda: self._forward_torch(x), x, self.weight)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, scale: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x = x + residual * scale`` (in x's dtype), then the norm; returns (new x, normed)."""
        def plain() -> tuple[torch.Tensor, torch.Tensor]:
            new_x = x + residual * scale if scale != 1.0 else x + residual
            return new_x, self._forward_torch(new_x)

        return call("rms_norm", lambda: pointwise_kernels.rms_norm(x, self.weight, self.eps, self.zero_centered,
                                                                   residual, scale, self.weight_in_float32),
                    plain, x, residual, self.weight)

    def add_and_norm_float32(self, x: torch.Tensor, residual: torch.Tensor, norm_rounded: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """A float32 residual stream: ``x = x.float() + residual``, then the norm of ``x.to(dtype)``
        (``norm_rounded``, a layer's norm) or of the float32 x cast to ``dtype`` after (a final norm),
        ``dtype`` the weight's. Returns (new x float32, normed in dtype)."""
        def plain() -> tuple[torch.Tensor, torch.Tensor]:
            dtype = self.weight.dtype
            new_x = x.float() + residual
            return new_x, (self._forward_torch(new_x.to(dtype)) if norm_rounded
                           else self._forward_torch(new_x).to(dtype))

        if self.zero_centered or self.weight_in_float32:
            return plain()
        return call("rms_norm_stream", lambda: pointwise_kernels.rms_norm_stream(x, self.weight, self.eps, residual,
                                                                                 norm_rounded),
                    plain, x, residual, self.weight)

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's gated group RMS norm: ``norm(x * silu(gate))`` over groups of ``group_size``."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()  # (T, D)
        if gate is not None:
            xf = xf * nn.functional.silu(gate.float())
        grouped = xf.view(*xf.shape[:-1], -1, self.group_size)  # (T, G, D/G)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(xf).to(dtype)
