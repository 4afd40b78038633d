"""Checks of option values shared by the engine's config (``config.py``) and the planner's
(``planning/plan_config.py``): sizes, positive counts and the cache-shape options. Imports nothing of the project."""

from __future__ import annotations

import re
from typing import Any

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
               "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(value: int | str) -> int:
    """A byte count given as an int or a string such as "2GiB", "512MB" (as ``config.parse_size``)."""
    if isinstance(value, bool):
        raise ValueError(f"cache_memory={value!r} is not a size; use bytes or a string such as '2GiB'")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        match = _SIZE_RE.match(str(value))
        if match is None:
            raise ValueError(f"cache_memory={value!r} is not a size; use bytes or a string such as '2GiB'")
        size = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])
    if size <= 0:
        raise ValueError(f"cache_memory={value!r} must be a positive size")
    return size


def check_positive_int(name: str, value: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer > 0 (a boolean is not)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def check_cache_shape_options(options: Any) -> None:
    """The checks EngineConfig and PlanConfig share: ``block_size``, ``max_model_len``, ``prefix_snapshot_interval``."""
    check_positive_int("block_size", options.block_size)
    if options.max_model_len is not None:
        check_positive_int("max_model_len", options.max_model_len)
    if not 1 <= options.block_size <= 64:
        raise ValueError(f"block_size={options.block_size!r} must be between 1 and 64 tokens")
    interval = options.prefix_snapshot_interval
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ValueError(f"prefix_snapshot_interval={interval!r} must be a whole number "
                         "of tokens >= 0 (0: no periodic snapshots)")
