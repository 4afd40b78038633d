"""Python entry points of the Q6_K weight linears (``csrc/gemm_w6k.h``, in the gemm library).

A weight in the format of ``ops/linear_w6k.py`` (codes (N, K) 0..63, sub-scales (N, K / 16) int8, super-scales
(N, K / 256) float16 values; K a multiple of 256) is packed once (:func:`pack`, plain PyTorch) into one uint8
buffer of :func:`packed_bytes`: per panel of 16 output columns, per super-block of 256 in-features, 3392 bytes:

* 16 sub-blocks of 16 k, 192 bytes each: three 64-byte vectors of 16 columns x 4 bytes, ``lo01`` and ``lo23``
  holding the low nibbles of the quads of k (0, 1) and (2, 3) (quad 0 or 2 in the low nibble of each byte), ``hi``
  the top two bits of all four quads (quad j at bits 2j, 2j + 1): byte i of column c's lane is k = 4 j + i;
* the sub-scales ``[16][16]`` int8, the super-scales ``[16]`` float16, 32 bytes of padding
  (columns past N: code 32, scales 0).

That is 0.83 bytes a weight (Q6_K's own blocks: 0.82). :func:`linear` computes
``x @ dequantize_w6k(...).T + bias`` for bf16, fp16 or float32 activations, or returns None when the call is one
the kernel does not cover (no library); :func:`path` says which of the kernel's paths a call takes.
"""

from __future__ import annotations

import torch

from hybridserve.kernels._abi import DTYPE_CODES, check
from hybridserve.kernels.gemm import LINEAR_DTYPES, PANEL, _library, linear_operands
from hybridserve.ops.linear_w6k import CODE_OFFSET, SUB_BLOCK, SUPER_BLOCK

BLOCK_BYTES = 3392  # bytes of one super-block of one panel (kW6kBlockBytes in csrc/gemm_w6k.h)
_CODE_BYTES = 16 * 192  # the sixteen sub-blocks' codes
A8_MAX_ROWS = 15  # rows up to which calls run on int8 activations from the avx2 level on (kW6kA8MaxRows)
AMX_ROWS = 16  # rows from which bf16 calls run on the AMX tiles at the amx level (kW6kAmxRows)
WIDENED_ROWS = 4  # rows from which other calls decode the codes once per row block (csrc/gemm_widened.h)
#: rows from which bf16 calls at avx512_bf16 run on the dot products over codes widened to bf16 once per call, where
#: the CPU prefers those dot products (AMD Zen 4/5; kDotWidenedRows in csrc/gemm_widened.h)
DOT_ROWS = 16
#: the path of activations quantized to int8 per super-block and integer sums (``linear_w6k_a8_ref``)
A8_PATH = "Q6_K x int8 activations, exact integer sums"  # VNNI at avx512_bf16 and amx, AVX2 at avx2, avx512
#: where :func:`linear` runs a call, by ``hs_w6k_path``' code
W6K_PATHS = ("float32 vectors", "AMX-BF16 tiles", A8_PATH, "float32 panels decoded once per row block",
             "bf16 dot products over codes widened to bf16 once per call")
_PACK_PANELS = 256  # panels packed at a time (4096 rows)


def check_in_features(in_features: int) -> None:
    """Raises ValueError unless ``in_features`` is a positive multiple of 256 (Q6_K's super-block)."""
    if in_features < SUPER_BLOCK or in_features % SUPER_BLOCK:
        raise ValueError(f"a Q6_K weight needs in-features a positive multiple of {SUPER_BLOCK} (its super-block), "
                         f"got {in_features}")


def packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes of a packed (out_features, in_features) Q6_K weight."""
    check_in_features(in_features)
    return -(-out_features // PANEL) * (in_features // SUPER_BLOCK) * BLOCK_BYTES


def _check_operands(codes: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor) -> None:
    """Raises ValueError naming the first operand that is not the format of ``ops/linear_w6k.py``."""
    if codes.dim() != 2 or codes.dtype != torch.uint8 or min(codes.shape) < 1:
        raise ValueError(f"codes must be a non-empty (N, K) uint8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    N, K = codes.shape
    check_in_features(K)
    if int(codes.max()) > 63:
        raise ValueError(f"codes must hold 0..63, got a code of {int(codes.max())}")
    if sub_scales.dtype != torch.int8 or tuple(sub_scales.shape) != (N, K // SUB_BLOCK):
        raise ValueError(f"sub_scales must be an int8 ({N}, {K // SUB_BLOCK}) tensor, got {sub_scales.dtype} "
                         f"{tuple(sub_scales.shape)}")
    if not super_scales.is_floating_point() or tuple(super_scales.shape) != (N, K // SUPER_BLOCK):
        raise ValueError(f"super_scales must be a float ({N}, {K // SUPER_BLOCK}) tensor, got {super_scales.dtype} "
                         f"{tuple(super_scales.shape)}")
    if not torch.equal(super_scales.float(), super_scales.to(torch.float16).float()):
        raise ValueError("super_scales must hold float16 values (Q6_K's d)")


def _pack_panels(codes: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor) -> torch.Tensor:
    """Whole panels: codes (P * 16, K), sub_scales (P * 16, K / 16), super_scales (P * 16, KB) -> (P, KB, 3392)."""
    rows, K = codes.shape
    P, KB = rows // PANEL, K // SUPER_BLOCK
    q = codes.view(P, PANEL, KB, 16, 4, 4).permute(0, 2, 3, 4, 1, 5)  # (P, KB, g, quad, column, i)
    lo01 = (q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)
    lo23 = (q[:, :, :, 2] & 15) | ((q[:, :, :, 3] & 15) << 4)
    hi = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    out = torch.zeros(P, KB, BLOCK_BYTES, dtype=torch.uint8)
    out[:, :, :_CODE_BYTES] = torch.stack([lo01, lo23, hi], dim=3).reshape(P, KB, _CODE_BYTES)
    out[:, :, _CODE_BYTES:_CODE_BYTES + 256] = (
        sub_scales.view(P, PANEL, KB, 16).permute(0, 2, 3, 1).reshape(P, KB, 256).view(torch.uint8))
    half = super_scales.to(torch.float16).view(P, PANEL, KB).permute(0, 2, 1).contiguous()
    out[:, :, _CODE_BYTES + 256:_CODE_BYTES + 288] = half.view(torch.uint8).view(P, KB, 32)
    return out


def pack(codes: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """codes (N, K) uint8 0..63, sub_scales (N, K / 16) int8, super_scales (N, K / 256) float16 values -> the packed
    uint8 buffer (:func:`packed_bytes`), written into ``out`` when given. Raises ValueError on operands outside the
    format (K not a multiple of 256 among them)."""
    _check_operands(codes, sub_scales, super_scales)
    N, K = codes.shape
    size = packed_bytes(N, K)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous uint8 CPU tensor of {size} bytes, "
                         f"got {out.dtype} {tuple(out.shape)}")
    packed = torch.empty(size, dtype=torch.uint8) if out is None else out
    panels, KB = -(-N // PANEL), K // SUPER_BLOCK
    dest = packed.view(panels, KB, BLOCK_BYTES)
    for p0 in range(0, panels, _PACK_PANELS):  # a slice of panels at a time: the temporaries stay small
        p1 = min(panels, p0 + _PACK_PANELS)
        r0, r1, n1 = p0 * PANEL, p1 * PANEL, min(N, p1 * PANEL)
        q = torch.full((r1 - r0, K), CODE_OFFSET, dtype=torch.uint8)
        sc = torch.zeros(r1 - r0, K // SUB_BLOCK, dtype=torch.int8)
        d = torch.zeros(r1 - r0, KB)
        q[:n1 - r0], sc[:n1 - r0], d[:n1 - r0] = codes[r0:n1], sub_scales[r0:n1], super_scales[r0:n1].float()
        dest[p0:p1] = _pack_panels(q, sc, d)
    return packed


def unpack(packed: torch.Tensor, out_features: int, in_features: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes (N, K) uint8, sub_scales (N, K / 16) int8 and super_scales (N, K / 256) float32 a buffer from
    :func:`pack` holds."""
    N, K = out_features, in_features
    panels, KB = -(-N // PANEL), K // SUPER_BLOCK
    blocks = packed.view(panels, KB, BLOCK_BYTES)
    parts = blocks[:, :, :_CODE_BYTES].reshape(panels, KB, 16, 3, PANEL, 4)  # (P, KB, g, vector, column, i)
    lo01, lo23, hi = (parts[:, :, :, v] for v in range(3))
    quads = [(lo01 & 15) | ((hi & 3) << 4), (lo01 >> 4) | (((hi >> 2) & 3) << 4),
             (lo23 & 15) | (((hi >> 4) & 3) << 4), (lo23 >> 4) | (((hi >> 6) & 3) << 4)]
    q = torch.stack(quads, dim=3)  # (P, KB, g, quad, column, i)
    codes = q.permute(0, 4, 1, 2, 3, 5).reshape(panels * PANEL, K)[:N]
    sc = blocks[:, :, _CODE_BYTES:_CODE_BYTES + 256].contiguous().view(torch.int8).view(panels, KB, 16, PANEL)
    sub_scales = sc.permute(0, 3, 1, 2).reshape(panels * PANEL, K // SUB_BLOCK)[:N]
    d = blocks[:, :, _CODE_BYTES + 256:_CODE_BYTES + 288].contiguous().view(torch.float16).view(panels, KB, PANEL)
    super_scales = d.permute(0, 2, 1).reshape(panels * PANEL, KB)[:N].float()
    return codes.contiguous(), sub_scales.contiguous(), super_scales.contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ dequantize_w6k(codes, sub_scales, super_scales).T + bias`` for x (..., K) bf16, fp16 or float32, the
    weight packed by :func:`pack`; (..., out_features) in x's dtype. None when not covered."""
    lib = _library()
    K = x.shape[-1]
    if (lib is None or x.dtype not in LINEAR_DTYPES or not x.is_cpu or K < SUPER_BLOCK or K % SUPER_BLOCK
            or packed.dtype != torch.uint8 or packed.numel() != packed_bytes(out_features, K)):
        return None
    operands = linear_operands(x, bias, out_features)
    if operands is None:
        return None
    x2, out = operands
    check(lib.hs_linear_w6k(DTYPE_CODES[x.dtype], x2.shape[0], out_features, K, x2.data_ptr(), x2.stride(0),
                            packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                            out_features), "hs_linear_w6k")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def path(rows: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Which path :func:`linear` takes for a call of ``rows`` rows of ``dtype`` activations here (one of
    :data:`W6K_PATHS`); None without the kernels."""
    lib = _library()
    if lib is None:
        return None
    return W6K_PATHS[lib.hs_w6k_path(DTYPE_CODES[dtype], rows)]
