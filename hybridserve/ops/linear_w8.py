"""8-bit weights: symmetric int8 quantization, dequantization, and the plain-PyTorch linear over them
(``linear_w8_ref``: dequantize, then matmul), the reference of the ``hs_linear_w8`` kernel; and W8A8
(``linear_w8a8_ref``: activations quantized per row too, integer sums), the reference of ``hs_linear_w8a8``.

Scales are float32 (N, G): G groups of ``group`` consecutive in-features per output channel (``group``
0: one group, a scale per output channel). A weight is ``W[n, k] = q[n, k] * s[n, k // group]``.
"""

from __future__ import annotations

import torch

INT8_MAX = 127  # symmetric: codes in [-127, 127], so -q is a code too


def _grouped(t: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """t (N, K) -> (N, G, gs) zero-padded along K, and gs."""
    N, K = t.shape
    gs = K if group <= 0 or group >= K else group
    G = -(-K // gs)
    padded = torch.nn.functional.pad(t, (0, G * gs - K)) if G * gs != K else t
    return padded.reshape(N, G, gs), gs


def quantize_int8(weight: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> codes (N, K) int8 in [-127, 127] and scales (N, G) float32, the scale of a
    group its largest |w| / 127 (1 for an all-zero group), each code ``round(w / s)`` (half to even)."""
    w = weight.detach().float()
    g, _ = _grouped(w, group)  # (N, G, gs)
    amax = g.abs().amax(dim=-1)  # (N, G)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(g / scales[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(w.shape[0], -1)[:, :w.shape[1]].contiguous(), scales.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor, group: int = 0) -> torch.Tensor:
    """codes (N, K) int8 or float8 and scales (N, G) -> the float32 weight (N, K), ``q * s`` per group."""
    g, gs = _grouped(q.float(), group)
    return (g * scales.float()[..., None]).reshape(q.shape[0], -1)[:, :q.shape[1]]


def linear_w8_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int = 0,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ dequantize(q, scales).T + bias in float32 -> (..., N) rounded to x's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), dequantize(q, scales, group), b).to(x.dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> codes (M, K) int8 in [-127, 127] and scales (M,) float32, one per row: the largest |x| / 127
    (1 for a row of zeros), each code ``round(x * (127 / max|x|))`` (half to even) in float32."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # (M,)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    # 127 / max|x| as a correctly rounded float32 division (``127 / tensor`` multiplies by a reciprocal)
    inverse = torch.where(amax > 0, torch.full_like(amax, INT8_MAX) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inverse[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def linear_w8a8_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x (..., K) quantized per row (:func:`quantize_rows_int8`) times int8 codes q (N, K) with one
    scale per output channel (scales (N, 1) or (N,)), the sums exact in integers, then
    ``float(sum) * s_w * s_x + bias`` in float32 -> (..., N) rounded to x's dtype."""
    K, N = x.shape[-1], q.shape[0]
    xq, sx = quantize_rows_int8(x.reshape(-1, K))
    sums = (xq.long() @ q.long().T).float()  # (M, N): exact integers, rounded once to float32
    y = sums * scales.reshape(1, N).float() * sx[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], N)
