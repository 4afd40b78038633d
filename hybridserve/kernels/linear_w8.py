"""Python entry points of the 8-bit weight linears (``csrc/gemm_w8.h``, in the gemm library).

A weight of 8-bit codes q (N, K), int8 or fp8 e4m3, with float32 scales s (N, G) (G groups of
``group`` consecutive in-features; ``group`` 0: one scale per output channel) is packed once
(:func:`pack`) into one uint8 buffer of :func:`packed_bytes`; :func:`linear` then computes
``x @ (q * s).T + bias`` for bf16, fp16 or float32 activations, widening the codes to float32 in
registers, the float32 sums rounded once to the activation dtype. Both return None, doing nothing,
when the call is one the kernel does not cover; :func:`unpack` gives the codes and scales back (the
plain-PyTorch path of a declined call, and the tests).

:func:`linear_w8a8` is W8A8 over the same packed int8 weights (one scale per output channel): each row of
x quantized to int8 with its own scale, the products summed exactly in int32 (:func:`w8a8_sums` says where),
``ops/linear_w8.py: linear_w8a8_ref``.
"""

from __future__ import annotations

import torch

from hybridserve.kernels._abi import DTYPE_CODES, check
from hybridserve.kernels.gemm import LINEAR_DTYPES, PANEL, _library, linear_operands
from hybridserve.kernels.gemm import W8_FORMATS as FORMATS  # the 8-bit weight dtypes and their codes

AMX_ROWS = 4  # rows from which bf16 calls run on the AMX tiles at the amx level (kW8AmxRows in csrc/gemm_w8.h)
W8A8_VNNI_ROWS = 8  # rows up to which W8A8 sums on AVX-512 VNNI where the tiles take more (kW8a8VnniRows)


def num_groups(in_features: int, group: int) -> int:
    """Scale groups per output channel: one when ``group`` is 0 or covers the whole row."""
    return 1 if group <= 0 or group >= in_features else -(-in_features // group)


def packed_bytes(out_features: int, in_features: int, group: int = 0) -> int:
    """Bytes of a packed (out_features, in_features) 8-bit weight: codes and scales of whole 16-column panels."""
    rows = -(-out_features // PANEL) * PANEL
    return rows * in_features + rows * num_groups(in_features, group) * 4


def pack(q: torch.Tensor, scales: torch.Tensor, group: int = 0, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """codes q (N, K) int8 or float8_e4m3fn and scales (N, G) float32 -> the packed uint8 buffer
    (:func:`packed_bytes`), written into ``out`` when given; None when not covered."""
    lib = _library()
    if (lib is None or q.dim() != 2 or q.dtype not in FORMATS or q.device.type != "cpu" or q.stride(1) != 1
            or min(q.shape) < 1 or group < 0):
        return None
    N, K = q.shape
    G = num_groups(K, group)
    if scales.dtype != torch.float32 or tuple(scales.shape) != (N, G) or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous float32 ({N}, {G}) tensor, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    size = packed_bytes(N, K, group)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous uint8 CPU tensor of {size} bytes, "
                         f"got {out.dtype} {tuple(out.shape)}")
    packed = torch.empty(size, dtype=torch.uint8) if out is None else out
    check(lib.hs_pack_w8(N, K, group, q.data_ptr(), q.stride(0), scales.data_ptr(), packed.data_ptr()), "hs_pack_w8")
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, fmt: torch.dtype, group: int,
           bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ (q * s).T + bias`` for x (..., K) bf16, fp16 or float32, the weight packed by :func:`pack`
    from codes of dtype ``fmt``; (..., out_features) in x's dtype. None when not covered."""
    lib = _library()
    K = x.shape[-1]
    if (lib is None or x.dtype not in LINEAR_DTYPES or not x.is_cpu or fmt not in FORMATS or packed.dtype != torch.uint8
            or packed.numel() != packed_bytes(out_features, K, group)):
        return None
    operands = linear_operands(x, bias, out_features)
    if operands is None:
        return None
    x2, out = operands
    rc = lib.hs_linear_w8(DTYPE_CODES[x.dtype], FORMATS[fmt], x2.shape[0], out_features, K, group, x2.data_ptr(),
                          x2.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                          out_features)
    if rc != 0:
        check(rc, "hs_linear_w8")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


#: where :func:`linear_w8a8` sums, by ``hs_w8a8_sums``' code
W8A8_SUMS = ("integer vectors", "AVX-512 VNNI", "AMX-INT8 tiles")


def w8a8_sums() -> str | None:
    """Where :func:`linear_w8a8` sums its int8 products here (one of :data:`W8A8_SUMS`: AMX-INT8 tiles at the amx
    level on a CPU with AMX-INT8, there up to :data:`W8A8_VNNI_ROWS` rows on AVX-512 VNNI; AVX-512 VNNI at
    avx512_bf16 and at amx without AMX-INT8, integer vectors at the levels below); None without the kernels."""
    lib = _library()
    return None if lib is None else W8A8_SUMS[lib.hs_w8a8_sums()]


def w8a8_on_tiles() -> bool:
    """Whether :func:`linear_w8a8` runs on AMX-INT8 tiles here."""
    return w8a8_sums() == W8A8_SUMS[2]


def linear_w8a8(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
                ) -> torch.Tensor | None:
    """W8A8 ``quantize_rows(x) @ q.T * s_w * s_x + bias`` for x (..., K) bf16, fp16 or float32 over int8 codes
    packed by :func:`pack` with one scale per output channel; (..., out_features) in x's dtype. None when
    not covered."""
    lib = _library()
    K = x.shape[-1]
    if (lib is None or x.dtype not in LINEAR_DTYPES or not x.is_cpu or packed.dtype != torch.uint8
            or packed.numel() != packed_bytes(out_features, K, 0) or K >= 1 << 17):
        return None
    operands = linear_operands(x, bias, out_features)
    if operands is None:
        return None
    x2, out = operands
    check(lib.hs_linear_w8a8(DTYPE_CODES[x.dtype], x2.shape[0], out_features, K, x2.data_ptr(), x2.stride(0),
                             packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                             out_features), "hs_linear_w8a8")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def unpack(packed: torch.Tensor, out_features: int, in_features: int, fmt: torch.dtype,
           group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (N, K) of dtype ``fmt`` and scales (N, G) float32 a buffer from :func:`pack` holds."""
    N, K = out_features, in_features
    rows = -(-N // PANEL) * PANEL
    G = num_groups(K, group)
    codes = packed[:rows * K].view(rows // PANEL, K, PANEL).permute(0, 2, 1).reshape(rows, K)[:N]
    scales = packed[rows * K:].view(torch.float32).view(rows // PANEL, G, PANEL).permute(0, 2, 1).reshape(rows, G)[:N]
    return codes.contiguous().view(fmt), scales.contiguous()
