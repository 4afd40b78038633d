"""Cache and model dtypes by name, without importing torch.

The option names (``bfloat16``, ``fp8_e4m3``, ...) of :mod:`hybridserve.config`, the bytes per element of
each, and the checkpoint's declared dtypes read from config values. Everything here accepts a torch dtype
or its name alike (``torch.bfloat16`` and ``"bfloat16"``), so the planner can describe caches from a
config.json alone while the engine passes real torch dtypes through the same functions.
"""

from __future__ import annotations

from typing import Any

from hybridserve.options import (  # the name tables, defined once in the options module
    DEVICES,
    DTYPE_ALIASES,
    FP8_KV_DTYPE_NAMES,
    KV_CACHE_DTYPE_NAMES,
    MODEL_DTYPE_NAMES,
    STATE_DTYPE_NAMES,
    canonical_option,
)

__all__ = ["DEVICES", "DTYPE_ALIASES", "FP8_KV_DTYPE_NAMES", "ITEMSIZE", "KV_CACHE_DTYPE_NAMES", "MODEL_DTYPE_NAMES",
           "STATE_DTYPE_NAMES", "TORCH_NAMES", "canonical_option", "checkpoint_dtype_name",
           "checkpoint_ssm_dtype_name", "dtype_name", "dtype_size", "is_coded_state_dtype", "torch_name"]

#: option name -> torch's attribute name, where they differ
TORCH_NAMES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: bytes per element, by torch's attribute name
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def torch_name(dtype: Any) -> str:
    """torch's attribute name of a torch dtype or an option name (``"fp8_e4m3"`` -> ``"float8_e4m3fn"``)."""
    name = str(dtype).removeprefix("torch.")
    return TORCH_NAMES.get(name, name)


#: torch's names of the code dtypes of 8-bit state (cache/state_codec.py: codes plus a bfloat16 scale per row)
CODED_STATE_TORCH_NAMES = ("int8", "float8_e4m3fn")
#: the dtype of an 8-bit state's row scales
STATE_SCALE_DTYPE = "bfloat16"


def is_coded_state_dtype(dtype: Any) -> bool:
    """Whether a state tensor in ``dtype`` (torch dtype or name) is stored as 8-bit codes plus row scales."""
    return torch_name(dtype) in CODED_STATE_TORCH_NAMES


def dtype_name(dtype: Any) -> str:
    """The option-style name of a torch dtype or a name (``torch.float8_e4m3fn`` -> ``"fp8_e4m3"``)."""
    name = torch_name(dtype)
    for option, torch_attr in TORCH_NAMES.items():
        if torch_attr == name:
            return option
    return name


def dtype_size(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a dtype name."""
    size = getattr(dtype, "itemsize", None)  # a torch.dtype
    if isinstance(size, int):
        return size
    name = torch_name(dtype)
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} has no known size; known: {', '.join(ITEMSIZE)}")
    return ITEMSIZE[name]


def _model_dtype_of(value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    return name if name in MODEL_DTYPE_NAMES else None


def checkpoint_dtype_name(config: Any) -> str:
    """The checkpoint's declared weight dtype (``dtype`` / ``torch_dtype``), float32 when it declares none."""
    for key in ("dtype", "torch_dtype"):
        found = _model_dtype_of(getattr(config, key, None))
        if found is not None:
            return found
    return "float32"


def checkpoint_ssm_dtype_name(config: Any) -> str | None:
    """A recurrent-state dtype the checkpoint declares (``mamba_ssm_cache_dtype`` / ``mamba_ssm_dtype``)."""
    for key in ("mamba_ssm_cache_dtype", "mamba_ssm_dtype"):
        value = getattr(config, key, None)
        if value in (None, "auto"):
            continue
        found = _model_dtype_of(value)
        if found is not None:
            return found
    return None
