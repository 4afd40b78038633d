"""Loud fallbacks: every call an op entry sends to its PyTorch body while the CPU kernels are on
(``ops/dispatch.py``), and every call a kernel's faster path declines (the Mamba2 scan's chunked form on the
AMX tiles, ``mamba2_chunked_scan``), is counted here by op and reason, and the first of each kind is logged.
``hybridserve env --model`` and the server's ``/metrics`` (``hybridserve:kernel_fallbacks_total{op,reason}``)
report the counts; tests assert that supported configurations have none."""

from __future__ import annotations

import logging
import threading
from collections import Counter

from hybridserve.cache.state_codec import CODED_VIEWS, StateView

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()


def describe(*tensors: StateView | None) -> str:
    """A short, low-cardinality reason from the inputs a kernel declined: their dtypes and whether
    each has contiguous rows (``bfloat16 strided``, say); an 8-bit state as ``int8 state codes``."""
    parts = []
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, CODED_VIEWS):
            parts.append(f"{str(t.dtype).removeprefix('torch.')} state codes")
            continue
        rows = t.dim() >= 1 and (t.stride(-1) == 1 or t.shape[-1] == 1)
        parts.append(f"{str(t.dtype).removeprefix('torch.')} {'rows' if rows else 'strided'}"
                     + ("" if t.device.type == "cpu" else f" on {t.device.type}"))
    return ", ".join(parts) or "not covered"


def record(op: str, reason: str) -> None:
    """Count one declined call of ``op``; the first of each (op, reason) is logged as a WARNING."""
    with _lock:
        _counts[(op, reason)] += 1
        first = _counts[(op, reason)] == 1
    if first:
        logger.warning("CPU kernel %s declined a call (%s): running it in plain PyTorch (counted in "
                       "hybridserve:kernel_fallbacks_total)", op, reason)


def counts() -> dict[tuple[str, str], int]:
    """(op, reason) -> declined calls so far in this process."""
    with _lock:
        return dict(_counts)


def total() -> int:
    with _lock:
        return sum(_counts.values())


def reset() -> None:
    """Forget the counts (tests)."""
    with _lock:
        _counts.clear()
