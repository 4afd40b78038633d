"""Calling the compiled kernels: library binding from each library's registry, and argument checks.

A library's registry (``csrc/registry.h``) lists its kernels with their signatures, derived by the
compiler from their one declaration in ``csrc/kernels.h``. :func:`bind` reads it and sets every
function's ctypes argument types from it, so the C signatures are written nowhere in Python. Every
call goes through a :class:`Kernel`, which checks the argument count and, while a decode step is
being captured (``kernels/graph.py``), records the call.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch

from hybridserve.kernels import isa
from hybridserve.kernels.build import load_library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
I64, PTR, INT, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
#: registry.h's signature characters
CTYPES: dict[str, type[ctypes._SimpleCData[Any]]] = {"i": INT, "l": I64, "f": F32, "p": PTR, "w": PTR}

_bound: dict[tuple[str, str], "KernelLibrary | None"] = {}  # (name, ISA level) -> bound library


class CallRecorder(Protocol):
    """A capture in progress (``kernels/graph.py``): it records every kernel call."""

    def record(self, kernel: Kernel, args: tuple) -> None:
        """Note the call of ``kernel`` with ``args``."""
        ...


recorder: CallRecorder | None = None  # the capture in progress (kernels/graph.py sets it), or None


class Kernel:
    """One registered C function: ``kernel(*args)`` calls it (its return code), recording the call
    while a capture is in progress."""

    __slots__ = ("name", "signature", "address", "invoker", "_fn")

    def __init__(self, name: str, signature: str, address: int, invoker: int) -> None:
        self.name, self.signature, self.address, self.invoker = name, signature, address, invoker
        fn = ctypes.CFUNCTYPE(INT, *(CTYPES[c] for c in signature))(address)
        self._fn = fn

    def __call__(self, *args) -> int:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments ({self.signature}), got {len(args)}")
        if recorder is not None:
            recorder.record(self, args)
        return self._fn(*args)

    def __repr__(self) -> str:
        return f"Kernel({self.name}, {self.signature})"


class KernelLibrary:
    """A loaded kernel library: its registered kernels as attributes (``lib.hs_rms_norm(...)``)."""

    def __init__(self, name: str, cdll: ctypes.CDLL) -> None:
        self.name = name
        self.cdll = cdll
        self.kernels: dict[str, Kernel] = {}
        cdll.hs_registry_size.restype = INT
        cdll.hs_registry_entry.restype = INT
        cdll.hs_registry_entry.argtypes = [INT] + [ctypes.POINTER(ctypes.c_void_p)] * 4
        for i in range(cdll.hs_registry_size()):
            fields = [ctypes.c_void_p() for _ in range(4)]
            if cdll.hs_registry_entry(i, *(ctypes.byref(f) for f in fields)) != 0:
                raise RuntimeError(f"library {name}: registry entry {i} unreadable")
            raw_name, raw_signature = (ctypes.cast(f, ctypes.c_char_p).value for f in fields[:2])
            address, invoker = fields[2].value, fields[3].value
            if raw_name is None or raw_signature is None or address is None or invoker is None:
                raise RuntimeError(f"library {name}: registry entry {i} has a null field")
            fn_name, signature = raw_name.decode(), raw_signature.decode()
            if any(c not in CTYPES for c in signature):
                raise RuntimeError(f"library {name}: {fn_name} has an unknown signature {signature!r}")
            self.kernels[fn_name] = Kernel(fn_name, signature, address, invoker)
        self.__dict__.update(self.kernels)

    def __getattr__(self, item: str):
        raise AttributeError(f"kernel library {self.name!r} registers no {item!r} (it has {sorted(self.kernels)})")


def bind(name: str) -> KernelLibrary | None:
    """Library ``name`` built for the ISA level in force (built on first use), its kernels bound from
    its registry; None if unavailable."""
    key = (name, isa.level_in_force())
    lib = _bound.get(key)
    if lib is None and key not in _bound:
        cdll = load_library(name, key[1])
        lib = KernelLibrary(name, cdll) if cdll is not None else None
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
