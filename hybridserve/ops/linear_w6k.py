"""GGUF Q6_K weights, the plain-PyTorch reference: the format every Q6_K path is tested against.

A weight (N, K), K a multiple of 256, is ``codes`` (N, K) uint8 holding 0..63, ``sub_scales`` (N, K / 16) int8 (one
per 16 consecutive in-features) and ``super_scales`` (N, K / 256) float32 holding float16 values (one per
super-block of 256): ``w = (d * sc) * (q - 32)``, the product ``d * sc`` exact in float32 and the second one
rounded once, as ``gguf.quants.dequantize`` computes it.

:func:`linear_w6k_a8_ref` is the product of the few-row kernel path (``kernels/csrc/gemm_w6k.h``): the activations
quantized to int8 per super-block of 256 k, the sums exact in integers.
"""

from __future__ import annotations

import torch

from hybridserve.ops.linear_w4 import quantize_blocks_int8

__all__ = ["CODE_OFFSET", "SUB_BLOCK", "SUPER_BLOCK", "dequantize_w6k", "linear_w6k_a8_ref", "linear_w6k_ref"]

SUPER_BLOCK = 256  # in-features of a super-block (one float16 d)
SUB_BLOCK = 16  # in-features of a sub-block (one int8 sc)
CODE_OFFSET = 32  # the code of zero


def dequantize_w6k(codes: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor) -> torch.Tensor:
    """codes (N, K) uint8 0..63, sub_scales (N, K / 16) int8, super_scales (N, K / 256) -> float32 (N, K)."""
    N, K = codes.shape
    scale = super_scales.float().repeat_interleave(SUPER_BLOCK // SUB_BLOCK, dim=1) * sub_scales.float()  # exact
    centred = codes.float().view(N, K // SUB_BLOCK, SUB_BLOCK) - CODE_OFFSET
    return (centred * scale[..., None]).view(N, K)


def linear_w6k_ref(x: torch.Tensor, codes: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ dequantize_w6k(...).T + bias in float32 -> (..., N) rounded to x's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), dequantize_w6k(codes, sub_scales, super_scales), b).to(x.dtype)


def linear_w6k_a8_ref(x: torch.Tensor, codes: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) quantized per super-block of 256 k (``ops/linear_w4.py: quantize_blocks_int8``: codes xq, block
    scales sx) times the codes q (N, K): per 16-k sub-block g the sums ``isum_g = sum q xq`` and ``xsum_g = sum
    xq``, per super-block b the integer ``t_b = sum_g sc_g (isum_g - 32 xsum_g)`` (exact); then in float32, each
    step rounded once, ``acc = acc + float(t_b) * (d_b * sx_b)`` over the super-blocks in order, and ``acc + bias``
    rounded to x's dtype -> (..., N)."""
    K, N = x.shape[-1], codes.shape[0]
    B, G = K // SUPER_BLOCK, K // SUB_BLOCK
    xq, sx = quantize_blocks_int8(x.reshape(-1, K), SUPER_BLOCK)  # (M, K), (M, B)
    M = xq.shape[0]
    xg = xq.long().view(M, G, SUB_BLOCK)
    isums = torch.einsum("mgk,ngk->mng", xg, codes.long().view(N, G, SUB_BLOCK))  # (M, N, G): exact
    centred = isums - CODE_OFFSET * xg.sum(-1)[:, None, :]
    t = (centred * sub_scales.long()[None]).view(M, N, B, G // B).sum(-1)  # (M, N, B): exact, |t| < 2^31
    acc = torch.zeros(M, N)
    d = super_scales.float()
    for b in range(B):
        acc = acc + t[:, :, b].float() * (d[None, :, b] * sx[:, b, None])
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], N)
