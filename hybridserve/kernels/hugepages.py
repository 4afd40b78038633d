"""Memory for large, long-lived tensors on transparent huge pages, where the OS offers them.

A decode step streams every packed weight (240 MB on the benchmark model) from memory; on 4 KiB pages
that is a TLB miss every 4 KiB. On 2 MiB pages the benchmark model's 32-row linear layers, cycling
through their weights as a decode step does, ran 5-10% faster, and a whole 32-sequence decode step
1-3% faster (two engines in one process, steps alternated).

Linux with transparent huge pages in ``madvise`` (or ``always``) mode gives them to a region marked
with ``madvise(MADV_HUGEPAGE)`` before it is first touched; elsewhere this is a plain ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor of ``numel`` elements starting on a huge-page boundary, its
    whole huge pages marked for the OS to back with huge pages (a plain ``torch.empty`` where that is
    not possible or the tensor is under one huge page)."""
    madvise = _madvise()
    elem = torch.empty(0, dtype=dtype).element_size()
    size = numel * elem
    if madvise is None or size < HUGE_PAGE:
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(numel + HUGE_PAGE // elem, dtype=dtype)  # room to start on a boundary
    offset = (-raw.data_ptr()) % HUGE_PAGE // elem
    view = raw[offset:offset + numel]  # keeps raw alive
    madvise(view.data_ptr(), size // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # a refusal leaves 4 KiB pages
    return view
