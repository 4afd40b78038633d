"""4-bit group-wise weights, the plain-PyTorch reference: the format every 4-bit path is tested against.

A weight (N, K) in 4 bits is ``codes`` (N, K) uint8 holding 0..15, ``scales`` (N, G) float32 and ``mins``
(N, G) float32 or None, for G groups of ``group`` consecutive in-features (the last group may be short). An
element's value is ``codes * scale + min`` of its group; without mins the codes are centred: ``(codes - 8) * scale``.
``--quantization int4`` makes centred codes at load (``layers/linear_w4.py: quantize_w4_sub``); GGUF's Q4_0
(centred) and Q4_K (scale and min per 32-element sub-block) blocks map onto the same format exactly.

:func:`linear_w4a8_ref` is the W4A8 product of the few-row kernel path (``kernels/csrc/gemm_w4a8.h``): the
activations quantized to int8 per block of the weight's group, the sums exact in integers.
"""

from __future__ import annotations

import torch

from hybridserve.ops.linear_w8 import quantize_rows_int8

__all__ = ["CODE_CENTRE", "dequantize_w4", "linear_w4_ref", "linear_w4a8_ref", "quantize_blocks_int8"]

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


def linear_w4_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ dequantize_w4(...).T + bias in float32 -> (..., N) rounded to x's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), dequantize_w4(codes, scales, mins, group), b).to(x.dtype)


def quantize_blocks_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> codes (M, K) int8 and scales (M, G) float32 for G blocks of ``block`` consecutive k (the last
    may be short), each block quantized as :func:`ops.linear_w8.quantize_rows_int8` quantizes a row."""
    M, K = x.shape
    G = -(-K // block)
    padded = torch.nn.functional.pad(x.float(), (0, G * block - K))  # zeros: they change no block's max
    codes, scales = quantize_rows_int8(padded.view(M * G, block))
    return codes.view(M, G * block)[:, :K], scales.view(M, G)


def linear_w4a8_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W4A8: x (..., K) quantized per block of the weight's group (:func:`quantize_blocks_int8`: codes xq, block
    scales sx and code sums q) times the 4-bit codes c (N, K), the sums ``isum = sum_k c xq`` over each group exact
    in integers; then per group in float32, each step rounded once, ``v = float(isum - 8 q) * scale`` (centred) or
    ``v = float(isum) * scale + float(q) * min`` (mins), ``acc = acc + v * sx`` over the groups in order, and
    ``acc + bias`` rounded to x's dtype -> (..., N)."""
    K, N = x.shape[-1], codes.shape[0]
    gs = min(group, K)
    G = -(-K // gs)
    xq, sx = quantize_blocks_int8(x.reshape(-1, K), gs)  # (M, K), (M, G)
    pad = G * gs - K
    xg = torch.nn.functional.pad(xq.long(), (0, pad)).view(-1, G, gs)  # (M, G, gs)
    cg = torch.nn.functional.pad(codes.long(), (0, pad)).view(N, G, gs)  # (N, G, gs)
    isums = torch.einsum("mgk,ngk->gmn", xg, cg)  # (G, M, N): exact integers
    qsums = xg.sum(-1).T  # (G, M)
    acc = torch.zeros(xg.shape[0], N)
    for g in range(G):
        if mins is None:
            v = (isums[g] - CODE_CENTRE * qsums[g][:, None]).float() * scales[:, g].float()
        else:
            v = isums[g].float() * scales[:, g].float() + qsums[g][:, None].float() * mins[:, g].float()
        acc = acc + v * sx[:, g, None]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], N)
