"""GGUF block formats decoded into the engine's quantized-weight formats, as pure functions.

Each decoder takes one tensor's raw blocks (a uint8 array (rows, bytes per row), as ``gguf.GGUFReader`` gives
them) and returns codes, scales and mins whose values equal ``gguf.quants.dequantize`` exactly:

========  ==============================================  ===================================================
GGUF      block (llama.cpp's ggml-quants)                  engine format
========  ==============================================  ===================================================
Q8_0      32 int8 codes, an fp16 scale d                   8-bit: int8 codes, scale d per 32 (group 32)
Q6_K      256 6-bit codes, an int8 scale per 16, fp16 d    Q6_K (ops/linear_w6k.py): codes q, sc, d as they are
Q5_0      32 5-bit codes, an fp16 scale d                  8-bit: int8 codes q - 16, scale d (group 32)
Q4_0      32 4-bit codes, an fp16 scale d                  4-bit centred: codes q, scale d, no mins (group 32)
Q4_K      256 4-bit codes, 6-bit scale and min per 32,     4-bit with mins: codes q, scale d * sc,
          fp16 d and dmin                                  min -(dmin * m) (group 32), with d and -dmin
========  ==============================================  ===================================================

The products d * sc and dmin * m are exact in float32 (an fp16 times a 6- or 8-bit integer), so
``codes * scale + min`` (``ops/linear_w4.py``), ``codes * scale`` (``ops/linear_w8.py``) and
``(d * sc) * (q - 32)`` (``ops/linear_w6k.py``) round as gguf does; Q4_K's d and -dmin per 256 let the 4-bit
layer keep its scales and mins sub-scaled, exactly (``kernels/linear_w4.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256  # elements of a k-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type: its elements and bytes per block, the engine's code width and group size."""

    name: str
    block_elements: int
    block_bytes: int
    bits: int  # 8: int8 codes (kernels/linear_w8.py); 6: Q6_K (ops/linear_w6k.py); 4: codes 0..15 (linear_w4.py)
    group: int


FORMATS = {
    "Q8_0": BlockFormat("Q8_0", 32, 34, 8, 32),
    "Q6_K": BlockFormat("Q6_K", QK_K, 210, 6, 16),
    "Q5_0": BlockFormat("Q5_0", 32, 22, 8, 32),
    "Q4_0": BlockFormat("Q4_0", 32, 18, 4, 32),
    "Q4_K": BlockFormat("Q4_K", QK_K, 144, 4, 32),
}


def _blocks(raw: np.ndarray, fmt: BlockFormat) -> tuple[np.ndarray, int]:
    """raw (rows, row bytes) uint8 -> (rows * blocks per row, block bytes) and the number of rows."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    raw = raw.reshape(-1, raw.shape[-1])  # (E, N, bytes) of stacked experts: E * N rows
    rows = raw.shape[0]
    if raw.size % (rows * fmt.block_bytes):
        raise ValueError(f"{fmt.name}: {raw.size} bytes in {rows} rows is not a whole number of "
                         f"{fmt.block_bytes}-byte blocks per row")
    return raw.reshape(-1, fmt.block_bytes), rows


def _fp16(column: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n,) float32 from little-endian fp16."""
    return np.ascontiguousarray(column).view(np.float16).reshape(-1).astype(np.float32)


def decode_q8_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> codes (N, K) int8 and scales (N, K / 32) float32."""
    b, rows = _blocks(raw, FORMATS["Q8_0"])
    d = _fp16(b[:, :2])
    codes = b[:, 2:].view(np.int8)
    return torch.from_numpy(codes.reshape(rows, -1).copy()), torch.from_numpy(d.reshape(rows, -1).copy())


def decode_q6_k_parts(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K rows -> the format of ``ops/linear_w6k.py``: codes (N, K) uint8 0..63, sub-scales (N, K / 16) int8
    and super-scales (N, K / 256) float32 (the fp16 d)."""
    b, rows = _blocks(raw, FORMATS["Q6_K"])
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _fp16(b[:, 208:210])
    # each half of 128 elements: ql 64 bytes (low nibbles: elements 0..63, high: 64..127), qh 32 bytes
    # (2-bit pairs: elements l, l + 32, l + 64, l + 96)
    low_shifted = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low_shifted & 0x0F).reshape(n, 2, 4, 32)
    high_shifted = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high_shifted & 0x03).reshape(n, 2, 4, 32)
    codes = (low | (high << 4)).reshape(n, QK_K)
    return (torch.from_numpy(codes.reshape(rows, -1).copy()), torch.from_numpy(sc.reshape(rows, -1).copy()),
            torch.from_numpy(d.reshape(rows, -1).copy()))


def decode_q5_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 rows -> codes (N, K) int8 in -16..15 and scales (N, K / 32) float32: an fp16 d, 32 high bits (a
    little-endian uint32, bit j for element j), 16 bytes of low nibbles (elements 0..15 low, 16..31 high)."""
    b, rows = _blocks(raw, FORMATS["Q5_0"])
    n = b.shape[0]
    d = _fp16(b[:, :2])
    high_bits = np.ascontiguousarray(b[:, 2:6]).view("<u4").reshape(n, 1)
    high = ((high_bits >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)  # (n, 32)
    low = b[:, 6:].reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    codes = ((low & 0x0F).reshape(n, 32) | (high << 4)).astype(np.int16) - 16
    return (torch.from_numpy(codes.astype(np.int8).reshape(rows, -1).copy()),
            torch.from_numpy(d.reshape(rows, -1).copy()))


def decode_q4_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Q4_0 rows -> codes (N, K) uint8 0..15 (zero at 8), scales (N, K / 32) float32 and no mins."""
    b, rows = _blocks(raw, FORMATS["Q4_0"])
    n = b.shape[0]
    d = _fp16(b[:, :2])
    qs = b[:, 2:].reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)  # low: 0..15, high: 16..31
    codes = (qs & 0x0F).reshape(n, 32)
    return torch.from_numpy(codes.reshape(rows, -1).copy()), torch.from_numpy(d.reshape(rows, -1).copy()), None


def q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K block's 12 scale bytes (n, 12) -> the 6-bit scales and mins (n, 8) of its 8 sub-blocks: bytes 0..3
    hold scales 0..3 (low 6 bits), 4..7 mins 0..3, 8..11 the low nibbles of scales 4..7 and mins 4..7 (high),
    whose top 2 bits are the top bits of bytes 0..3 (scales) and 4..7 (mins)."""
    p = packed.reshape(-1, 3, 4)
    first, second, third = p[:, 0], p[:, 1], p[:, 2]
    scales = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 2) & 0x30)], axis=-1)
    return scales, mins


def decode_q4_k(raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Q4_K rows -> codes (N, K) uint8 0..15, scales (N, K / 32) float32 (d * sc), mins (N, K / 32) float32
    (-(dmin * m)), and the super-blocks' d and -dmin (N, K / 256) float32 (float16 values): every scale and min
    is its super-block's value times a 6-bit integer."""
    b, rows = _blocks(raw, FORMATS["Q4_K"])
    n = b.shape[0]
    d, dmin = _fp16(b[:, :2]), _fp16(b[:, 2:4])
    sc, m = q4_k_scale_min(b[:, 4:16])
    # 4 chunks of 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j + 1
    qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, QK_K)
    scales = d[:, None] * sc.astype(np.float32)
    mins = -(dmin[:, None] * m.astype(np.float32))
    return (torch.from_numpy(codes.reshape(rows, -1).copy()), torch.from_numpy(scales.reshape(rows, -1).copy()),
            torch.from_numpy(mins.reshape(rows, -1).copy()), torch.from_numpy(d.reshape(rows, -1).copy()),
            torch.from_numpy((-dmin).reshape(rows, -1).copy()))


DECODERS = {"Q8_0": decode_q8_0, "Q6_K": decode_q6_k_parts, "Q5_0": decode_q5_0, "Q4_0": decode_q4_0,
            "Q4_K": decode_q4_k}
