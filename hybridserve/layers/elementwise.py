"""Element-wise glue between layers (scalar and per-column multipliers, sums), on the CPU kernels
when they are on, each rounded to the activation dtype as the PyTorch expression is."""

from __future__ import annotations

import torch

from hybridserve.kernels import fallbacks
from hybridserve.kernels import pointwise as pointwise_kernels


def scale(x: torch.Tensor, factor: float | torch.Tensor, use_cpu_kernels: bool) -> torch.Tensor:
    """``x * factor``: a Python float, or a (D,) tensor in x's dtype scaling each column."""
    if use_cpu_kernels:
        out = pointwise_kernels.scale(x, factor)
        if out is not None:
            return out
        fallbacks.record("scale", fallbacks.describe(x))
    return x * factor


def mul(a: torch.Tensor, b: torch.Tensor, use_cpu_kernels: bool) -> torch.Tensor:
    """``a * b``, element by element."""
    if use_cpu_kernels:
        out = pointwise_kernels.mul(a, b)
        if out is not None:
            return out
        fallbacks.record("mul", fallbacks.describe(a, b))
    return a * b


def add(a: torch.Tensor, b: torch.Tensor, use_cpu_kernels: bool) -> torch.Tensor:
    """``a + b``."""
    if use_cpu_kernels:
        out = pointwise_kernels.add(a, b)
        if out is not None:
            return out
        fallbacks.record("add", fallbacks.describe(a, b))
    return a + b


def scaled_sum(a: torch.Tensor, alpha: float, b: torch.Tensor, beta: float, use_cpu_kernels: bool) -> torch.Tensor:
    """``a * alpha + b * beta``, each product rounded, then the sum (MiniMax's residual mixing)."""
    if use_cpu_kernels:
        left = pointwise_kernels.scale(a, alpha)
        out = None if left is None else pointwise_kernels.add(left, b, beta)
        if out is not None:
            return out
        fallbacks.record("scaled_sum", fallbacks.describe(a, b))
    return a * alpha + b * beta
