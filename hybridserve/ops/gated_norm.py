"""Mamba2's output gate as one op entry: ``y * silu(gate)`` then the gated group RMS norm (or the gate alone).

Two bodies, chosen in ``ops/dispatch.py``: the CPU kernels (``kernels/pointwise.py``: ``gated_rms_norm``,
``silu_gate``) and plain PyTorch (the layer's own norm module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.ops.dispatch import call


class GroupNorm(Protocol):
    """A gated group RMS norm (``layers/norms.py: GatedRMSNorm``): ``norm(x, gate)``, gate optional."""

    weight: torch.Tensor
    group_size: int
    eps: float
    __call__: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def gate_and_norm(y: torch.Tensor, gate: torch.Tensor, norm: GroupNorm | None, dtype: torch.dtype, *,
                  norm_before_gate: bool = False, norm_in_float32: bool = False) -> torch.Tensor:
    """y: (T, D) float32 scan output, gate: (T, D) -> (T, D) in ``dtype``.

    No norm: ``y * silu(gate)``. Else ``norm(y * silu(gate))`` with y rounded to ``dtype`` first (or kept in
    float32 with ``norm_in_float32``), or ``norm(y) * silu(gate)`` with ``norm_before_gate``.
    """
    return call("silu_gate" if norm is None else "gated_rms_norm",
                lambda: _kernel_body(y, gate, norm, dtype, norm_before_gate, norm_in_float32),
                lambda: _plain_body(y, gate, norm, dtype, norm_before_gate, norm_in_float32), y, gate)


def _kernel_body(y: torch.Tensor, gate: torch.Tensor, norm: GroupNorm | None, dtype: torch.dtype,
                 norm_before_gate: bool, norm_in_float32: bool) -> torch.Tensor | None:
    """The CPU-kernel body (None: declined)."""
    if gate.dtype != dtype:
        return None
    if norm is None:
        return pointwise_kernels.silu_gate(y, gate)
    return pointwise_kernels.gated_rms_norm(y, gate, norm.weight, norm.group_size, norm.eps, norm_in_float32,
                                            norm_before_gate)


def _plain_body(y: torch.Tensor, gate: torch.Tensor, norm: GroupNorm | None, dtype: torch.dtype,
                norm_before_gate: bool, norm_in_float32: bool) -> torch.Tensor:
    """The PyTorch body."""
    if norm is None:
        return (y * nn.functional.silu(gate)).to(dtype)
    if norm_before_gate:
        return (norm(y, None) * nn.functional.silu(gate.float())).to(dtype)
    if norm_in_float32:
        return norm(y, gate).to(dtype)
    return norm(y.to(dtype), gate)
