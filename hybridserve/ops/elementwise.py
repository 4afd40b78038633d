"""Element-wise glue between layers: sums, scalar and per-column multipliers, gates, column concatenation
and RoPE. Each entry runs the compiled CPU kernel or the PyTorch expression (``ops/dispatch.py``), the
kernel rounding to the activation dtype exactly as the expression does."""

from __future__ import annotations

import torch

from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.ops.dispatch import call


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b``."""
    return call("add", lambda: pointwise_kernels.add(a, b), lambda: a + b, a, b)


def scale(x: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """``x * factor``: a Python float, or a (D,) tensor in x's dtype scaling each column."""
    return call("scale", lambda: pointwise_kernels.scale(x, factor), lambda: x * factor, x)


def scaled_sum(a: torch.Tensor, alpha: float, b: torch.Tensor, beta: float) -> torch.Tensor:
    """``a * alpha + b * beta``, each product rounded, then the sum (MiniMax's residual mixing)."""
    def kernel() -> torch.Tensor | None:
        left = pointwise_kernels.scale(a, alpha)
        return None if left is None else pointwise_kernels.add(left, b, beta)

    return call("scaled_sum", kernel, lambda: a * alpha + b * beta, a, b)


def concat_cols(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (T, Da), b (T, Db) -> (T, Da + Db)."""
    return call("concat_cols", lambda: pointwise_kernels.concat_cols(a, b), lambda: torch.cat([a, b], dim=-1), a, b)


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)``, both of one shape."""
    return call("sigmoid_mul", lambda: pointwise_kernels.sigmoid_mul(gate, x), lambda: x * torch.sigmoid(gate),
                gate, x)


def head_sigmoid_gate(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """gate (T, H), x (T, H, Dh) -> ``x * sigmoid(gate)[..., None]``: one gate per head."""
    t, heads, dh = x.shape

    def kernel() -> torch.Tensor | None:
        gated = pointwise_kernels.row_sigmoid_gate(gate.reshape(t * heads, 1), x.reshape(t * heads, dh))
        return None if gated is None else gated.view(t, heads, dh)

    return call("row_sigmoid_gate", kernel, lambda: x * torch.sigmoid(gate)[..., None], gate, x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of ``x`` (T, H, Dh) by per-token ``cos``/``sin`` (T, R)
    (HF's half-rotation layout; plain PyTorch, a new tensor)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, R)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on x (T, H, Dh) with (cos, sin): in place by the CPU kernel where it covers the call, else
    :func:`apply_rotary` (a new tensor)."""
    t, heads, dh = x.shape

    def kernel() -> torch.Tensor | None:
        ok = x.is_contiguous() and pointwise_kernels.rotary(x.view(t, heads * dh), heads, dh, *rope)
        return x if ok else None

    return call("rotary", kernel, lambda: apply_rotary(x, *rope), x, rope[0])
