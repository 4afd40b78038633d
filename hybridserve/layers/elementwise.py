"""Element-wise glue between layers (scalar and per-column multipliers, sums), on the CPU
kernels when they are on, each rounded to the activation dtype as the PyTorch expression is."""

from __future__ import annotations

from typing import Callable

import torch

from hybridserve.kernels import fallbacks
from hybridserve.kernels import pointwise as pointwise_kernels


def _on_kernels(op: str, kernel: Callable[[], torch.Tensor | None], plain: Callable[[], torch.Tensor],
                use_cpu_kernels: bool, *inputs: torch.Tensor) -> torch.Tensor:
    """``kernel()`` when the kernels are on and it covers the call (a decline is counted), else ``plain()``."""
    if use_cpu_kernels:
        out = kernel()
        if out is not None:
            return out
        fallbacks.record(op, fallbacks.describe(*inputs))
    return plain()


def scale(x: torch.Tensor, factor: float | torch.Tensor, use_cpu_kernels: bool) -> torch.Tensor:
    """``x * factor``: a Python float, or a (D,) tensor in x's dtype scaling each column."""
    return _on_kernels("scale", lambda: pointwise_kernels.scale(x, factor), lambda: x * factor, use_cpu_kernels, x)


def add(a: torch.Tensor, b: torch.Tensor, use_cpu_kernels: bool) -> torch.Tensor:
    """``a + b``."""
    return _on_kernels("add", lambda: pointwise_kernels.add(a, b), lambda: a + b, use_cpu_kernels, a, b)


def scaled_sum(a: torch.Tensor, alpha: float, b: torch.Tensor, beta: float, use_cpu_kernels: bool) -> torch.Tensor:
    """``a * alpha + b * beta``, each product rounded, then the sum (MiniMax's residual mixing)."""
    def kernel() -> torch.Tensor | None:
        left = pointwise_kernels.scale(a, alpha)
        return None if left is None else pointwise_kernels.add(left, b, beta)

    return _on_kernels("scaled_sum", kernel, lambda: a * alpha + b * beta, use_cpu_kernels, a, b)
