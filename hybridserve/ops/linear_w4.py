"""4-bit group-wise weights, the plain-PyTorch reference: the format every 4-bit path is tested against.

A weight (N, K) in 4 bits is ``codes`` (N, K) uint8 holding 0..15, ``scales`` (N, G) float32 and ``mins``
(N, G) float32 or None, for G groups of ``group`` consecutive in-features (the last group may be short). An
element's value is ``codes * scale + min`` of its group; without mins the codes are centred: ``(codes - 8) * scale``.
``--quantization int4`` makes centred codes at load; GGUF's Q4_0 (centred) and Q4_K (scale and min per
32-element sub-block) blocks map onto the same format exactly.
"""

from __future__ import annotations

import torch

__all__ = ["CODE_CENTRE", "dequantize_w4", "linear_w4_ref", "quantize_w4"]

#: the code of zero without mins
CODE_CENTRE = 8


def _expand(per_group: torch.Tensor, group: int, K: int) -> torch.Tensor:
    """(N, G) -> (N, K): each group's value repeated over its in-features."""
    return per_group.repeat_interleave(group, dim=1)[:, :K]


def dequantize_w4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """codes (N, K) uint8 0..15, scales (N, G), mins (N, G) or None -> float32 (N, K)."""
    K = codes.shape[1]
    c = codes.to(torch.float32)
    if mins is None:
        return (c - CODE_CENTRE) * _expand(scales.float(), group, K)
    return c * _expand(scales.float(), group, K) + _expand(mins.float(), group, K)


def quantize_w4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> centred codes (N, K) uint8 and scales (N, G) float32: per group
    ``scale = max|w| / 7`` (1 for a group of zeros), ``code = clamp(round(w / scale), -8, 7) + 8``."""
    N, K = weight.shape
    G = -(-K // group)
    w = torch.nn.functional.pad(weight.float(), (0, G * group - K)).view(N, G, group)
    amax = w.abs().amax(dim=-1)  # (N, G)
    scales = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
    q = torch.round(w / scales[..., None]).clamp_(-8, 7) + CODE_CENTRE
    return q.view(N, G * group)[:, :K].to(torch.uint8), scales


def linear_w4_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ dequantize_w4(...).T + bias in float32 -> (..., N) rounded to x's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), dequantize_w4(codes, scales, mins, group), b).to(x.dtype)
