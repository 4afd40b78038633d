"""One compiled pass over a batch of logits rows (their argmax and logsumexp) for the sampler and the
verification of drafts, where the kernels are on (``ops/dispatch.py``); the callers compute the same values
in PyTorch otherwise."""

from __future__ import annotations

import torch

from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.ops.dispatch import kernels_on


def fused_argmax_logsumexp(logits: torch.Tensor, with_max: bool = False) -> tuple[torch.Tensor, ...] | None:
    """logits (N, V) -> (argmax (N,), logsumexp (N,) float32[, max (N,) float32]) from the kernel, or None
    when the kernels are off or it does not take these logits."""
    return pointwise_kernels.argmax_logsumexp(logits, with_max) if kernels_on() else None
