"""Calling the compiled kernels through ctypes: library binding and argument checks."""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from hybridserve.kernels import isa
from hybridserve.kernels.build import load_library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
I64, PTR, INT, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

_bound: dict[tuple[str, str], ctypes.CDLL | None] = {}  # (name, ISA level) -> bound library


def bind(name: str, signatures: dict[str, Sequence]) -> ctypes.CDLL | None:
    """Library ``name`` built for the ISA level in force (built on first use), with each function's
    argtypes set; None if unavailable."""
    key = (name, isa.level_in_force())
    lib = _bound.get(key)
    if lib is None and key not in _bound:
        lib = load_library(name, key[1])
        if lib is not None:
            for fn, argtypes in signatures.items():
                getattr(lib, fn).restype = INT
                getattr(lib, fn).argtypes = list(argtypes)
        _bound[key] = lib
    return lib


def rows_ok(t: torch.Tensor) -> bool:
    """A (T, width) CPU tensor whose rows are contiguous (a column slice of a row-major tensor is)."""
    return t.device.type == "cpu" and t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1)


def index_ok(t: torch.Tensor | None) -> bool:
    """A contiguous int64 CPU tensor."""
    return t is not None and t.device.type == "cpu" and t.dtype == torch.int64 and t.is_contiguous()


def float_param_ok(t: torch.Tensor | None) -> bool:
    """None, or a contiguous float32 CPU tensor."""
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of t (None for None)."""
    return None if t is None else t.data_ptr()


def check(rc: int, fn: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{fn} rejected its arguments (code {rc})")
