"""Weight bytes of a checkpoint for ``hybridserve plan``, from its safetensors headers alone (no torch):
bytes per stored dtype, and what ``--quantization int8`` and ``--quantization int4`` would hold.

The quantized figures are estimates by tensor names and shapes: every 2-D ``*.weight`` and 3-D stacked-expert
tensor becomes int8 codes plus one float32 scale per output row (rows rounded up to the kernel's panels of
16), or 4-bit codes (half a byte each, in-features rounded up to 8) plus a uint8 sub-scale per group of
in-features and a float16 super-scale per 256 (``kernels/linear_w4.py``; int8 where the in-features are not a
multiple of 8, as the engine does), except embeddings and routers (kept in their dtype, as the engine keeps them)
and 1-D tensors; a tied LM head gets a quantized copy beside its embedding. The engine's exact figures are
``LLM.cache_layout()["weight_bytes"]``.
"""

from __future__ import annotations

import json
import os
import re
import struct

#: safetensors dtype -> (option-style name, bytes per element)
_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F8_E4M3": ("fp8_e4m3", 1),
           "I8": ("int8", 1), "U8": ("uint8", 1), "I64": ("int64", 8), "I32": ("int32", 4), "F64": ("float64", 8)}
_KEPT = re.compile(r"(embed|wte\b|embedding|router|\.gate\.weight$|\.conv1d\.|_scale(_inv)?$)")
_PANEL = 16


def _headers(folder: str) -> list[dict]:
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    out = []
    for name in files:
        with open(os.path.join(folder, name), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        out.append(header)
    return out


def _int8_bytes(shape: list[int]) -> int:
    *experts, rows, cols = shape
    n = 1
    for e in experts:
        n *= e
    padded = -(-rows // _PANEL) * _PANEL
    return n * (padded * cols + padded * 4)


def _int4_bytes(shape: list[int], group: int) -> tuple[str, int]:
    """(label, bytes) of a tensor in 4 bits, or in int8 where the 4-bit kernel does not take its in-features."""
    *experts, rows, cols = shape
    if cols % 8 != 0 or (group % 8 != 0 and group < cols):
        return "int8", _int8_bytes(shape)
    n = 1
    for e in experts:
        n *= e
    padded = -(-rows // _PANEL) * _PANEL
    gs = min(group, cols)
    groups = -(-cols // gs)
    per_super = 256 // gs if 256 % gs == 0 else 1  # groups of a super-block (SUPER_K in kernels/linear_w4.py)
    return "int4", n * (padded * cols // 2 + padded * (groups + -(-groups // per_super) * 2))


def weight_bytes(folder: str, tied_head: bool = False, int4_group: int = 32) -> dict[str, dict[str, int]] | None:
    """``{"checkpoint": bytes per dtype, "int8": and "int4": estimated bytes per dtype}`` (``int4_group``:
    in-features per 4-bit scale); None without safetensors."""
    if not os.path.isdir(folder):
        return None
    headers = _headers(folder)
    if not headers:
        return None
    stored: dict[str, int] = {}
    int8: dict[str, int] = {}
    int4: dict[str, int] = {}
    for header in headers:
        for name, entry in header.items():
            dtype, size = _DTYPES.get(entry["dtype"], (entry["dtype"].lower(), 1))
            shape = entry["shape"]
            n = 1
            for d in shape:
                n *= d
            stored[dtype] = stored.get(dtype, 0) + n * size
            quantized = len(shape) in (2, 3) and not _KEPT.search(name) and (len(shape) == 2 or shape[1] > 1)
            if quantized and dtype != "fp8_e4m3":
                int8["int8"] = int8.get("int8", 0) + _int8_bytes(shape)
                label, nbytes = _int4_bytes(shape, int4_group)
                int4[label] = int4.get(label, 0) + nbytes
            else:
                int8[dtype] = int8.get(dtype, 0) + n * size
                int4[dtype] = int4.get(dtype, 0) + n * size
                if tied_head and "embed" in name and len(shape) == 2:
                    int8["int8"] = int8.get("int8", 0) + _int8_bytes(shape)
                    label, nbytes = _int4_bytes(shape, int4_group)
                    int4[label] = int4.get(label, 0) + nbytes
    return {"checkpoint": dict(sorted(stored.items())), "int8": dict(sorted(int8.items())),
            "int4": dict(sorted(int4.items()))}
