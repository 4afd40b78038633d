"""The engine's option defaults, name tables and checks, on the ground floor: standard library only.

``config.EngineConfig`` (torch dtypes), ``planning/plan_config.PlanConfig`` (the planner's options, dtype names),
``cache/*`` and ``structured_output/limits.py`` all take their defaults and checks from here, so every option
is checked once, with one message, whichever of them reads it; nothing here imports the rest of hybridserve.
"""

from __future__ import annotations

import re
from typing import Any

#: tokens between the periodic state snapshots of a long prefill (``prefix_snapshot_interval``; 0: none)
DEFAULT_SNAPSHOT_INTERVAL = 512

# -- dtype and device names (``cache/dtypes.py`` maps them to sizes and torch names) --

MODEL_DTYPE_NAMES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPE_NAMES = (*MODEL_DTYPE_NAMES, "fp8_e4m3", "fp8_e5m2")
STATE_DTYPE_NAMES = MODEL_DTYPE_NAMES
#: 8-bit temporal state: codes plus a bfloat16 scale per state row (cache/state_codec.py, docs/state_precision.md)
CODED_STATE_DTYPE_NAMES = ("int8", "fp8_e4m3")
#: what ``mamba_ssm_cache_dtype`` takes: the float state dtypes and the 8-bit coded ones
TEMPORAL_STATE_DTYPE_NAMES = (*STATE_DTYPE_NAMES, *CODED_STATE_DTYPE_NAMES)
#: 8-bit conv state: int8 codes plus an int8 power-of-two exponent per channel (cache/conv_codec.py)
CONV_CODED_DTYPE_NAMES = ("int8",)
#: what ``mamba_cache_dtype`` takes besides ``auto``
CONV_STATE_DTYPE_NAMES = (*STATE_DTYPE_NAMES, *CONV_CODED_DTYPE_NAMES)
FP8_KV_DTYPE_NAMES = ("fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")
#: weight quantization (config.py: EngineConfig.quantization; docs/quantization.md)
QUANTIZATIONS = ("auto", "none", "int8", "w8a8", "int4")
#: in-features per scale that quantization "int4" takes, and its default
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32

#: the spellings an option accepts besides its name (``config._DTYPE_ALIASES`` is this table)
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                 "fp16": "float16", "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}


def canonical_option(option: str, value: Any, allowed: tuple[str, ...]) -> str:
    """``value`` as one of ``allowed`` (aliases resolved); ValueError naming the option and the allowed values."""
    if not isinstance(value, str):
        raise ValueError(f"{option}={value!r} is not valid; allowed values: {', '.join(allowed)}")
    name = DTYPE_ALIASES.get(value.lower(), value.lower())
    if name not in allowed:
        raise ValueError(f"{option}={value!r} is not valid; allowed values: {', '.join(allowed)}")
    return name


def conv_state_dtype(value: Any) -> str:
    """``mamba_cache_dtype`` (conv states) as a canonical name; ValueError naming the value and the allowed ones,
    and for ``fp8_e4m3`` why it is refused."""
    name = DTYPE_ALIASES.get(value.lower(), value.lower()) if isinstance(value, str) else value
    if name in CODED_STATE_DTYPE_NAMES and name not in CONV_CODED_DTYPE_NAMES:
        raise ValueError(
            f"mamba_cache_dtype={value!r} is not valid: an 8-bit conv state is int8 (codes and a power-of-two "
            f"exponent per channel: docs/state_precision.md); use "
            f"--mamba-ssm-cache-dtype {name} for the recurrent state "
            f"(allowed mamba_cache_dtype values: auto, {', '.join(CONV_STATE_DTYPE_NAMES)})")
    return canonical_option("mamba_cache_dtype", value, ("auto", *CONV_STATE_DTYPE_NAMES))


# -- sizes and counts --

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
               "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def named_entry(flag: str, name: str, table: dict[str, Any]) -> Any:
    """``table[name]`` for the option ``flag``; a ValueError naming the value and listing the choices otherwise."""
    if name not in table:
        raise ValueError(f"{flag}={name!r} is not a known parser: choose one of {', '.join(sorted(table))}")
    return table[name]


def parse_size(value: int | str) -> int:
    """A byte count given as an int or a string such as "2GiB", "512MB" (``config.parse_size`` is this function)."""
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


# -- structured output's grammar limits (``structured_output/limits.py``, docs/structured_output.md) --

#: each grammar limit's engine option and CLI flag, as error messages name them
GRAMMAR_LIMIT_FLAGS = {"max_grammar_bytes": "--max-grammar-bytes",
         "max_grammar_compile_seconds": "--max-grammar-compile-seconds",
         "grammar_cache_bytes": "--grammar-cache-bytes"}
DEFAULT_MAX_GRAMMAR_BYTES = 64 * 2 ** 10
DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS = 5.0
DEFAULT_GRAMMAR_CACHE_BYTES = 256 * 2 ** 20


def parse_cache_bytes(value: int | str) -> int:
    """``grammar_cache_bytes`` given as bytes or a size such as "256MiB" (0 keeps no compiled grammar)."""
    if value == 0 or (isinstance(value, str) and value.strip() == "0"):
        return 0
    try:
        return parse_size(value)
    except ValueError:
        raise ValueError(f"grammar_cache_bytes={value!r} is not a size: use bytes or a size such as '256MiB' "
                         f"({GRAMMAR_LIMIT_FLAGS['grammar_cache_bytes']})") from None
