"""Weight bytes of a checkpoint for ``hybridserve plan``, from its safetensors headers alone (no torch):
bytes per stored dtype, and what ``--quantization int8`` would hold.

The int8 figure is an estimate by tensor names and shapes: every 2-D ``*.weight`` and 3-D stacked-expert
tensor becomes int8 codes plus one float32 scale per output row (rows rounded up to the kernel's panels of
16), except embeddings and routers (kept in their dtype, as the engine keeps them) and 1-D tensors; a tied
LM head gets an int8 copy beside its embedding. The engine's exact figures are ``LLM.cache_layout()
["weight_bytes"]``.
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


def weight_bytes(folder: str, tied_head: bool = False) -> dict[str, dict[str, int]] | None:
    """``{"checkpoint": bytes per dtype, "int8": estimated bytes per dtype}``; None without safetensors."""
    if not os.path.isdir(folder):
        return None
    headers = _headers(folder)
    if not headers:
        return None
    stored: dict[str, int] = {}
    int8: dict[str, int] = {}
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
            else:
                int8[dtype] = int8.get(dtype, 0) + n * size
                if tied_head and "embed" in name and len(shape) == 2:
                    int8["int8"] = int8.get("int8", 0) + _int8_bytes(shape)
    return {"checkpoint": dict(sorted(stored.items())), "int8": dict(sorted(int8.items()))}
