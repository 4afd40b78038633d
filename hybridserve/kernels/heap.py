"""Give the C heap's free pages back to the OS (glibc's ``malloc_trim``).

torch's CPU tensors below glibc's mmap threshold (which grows up to 32 MiB as large blocks are freed) live on the
C heap; freeing them leaves their pages resident until the heap is trimmed. Loading replaces many such tensors by
packed copies in other memory (``layers/packed_linear.py``): trimming as they go keeps the old and the new from
being counted together.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another libc or platform)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS; whether glibc's ``malloc_trim`` ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
