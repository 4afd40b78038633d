"""The engine options a cache plan depends on, validated without torch dtypes (``hybridserve plan``).

:class:`PlanConfig` holds the fields of :class:`hybridserve.config.EngineConfig` that decide the cache
(dtype options, block size, cache memory, length, device, capture and prefix caching) and checks them
with the same rules and messages; its dtypes resolve to names (:class:`ResolvedDtypeNames`). The
planner takes either class. ``tests/entrypoints/test_plan_cmd.py`` checks both agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from hybridserve.cache.dtypes import checkpoint_dtype_name, checkpoint_ssm_dtype_name
from hybridserve.options import (
    DEFAULT_SNAPSHOT_INTERVAL,
    DEVICES,
    KV_CACHE_DTYPE_NAMES,
    MODEL_DTYPE_NAMES,
    TEMPORAL_STATE_DTYPE_NAMES,
    canonical_option,
    check_cache_shape_options,
    check_positive_int,
    conv_state_dtype,
    parse_size,
)
from hybridserve.spec_decode.config import parse_speculative_config

__all__ = ["PlanConfig", "ResolvedDtypeNames", "check_cache_shape_options", "check_positive_int", "cuda_available",
           "parse_size"]

@dataclass(frozen=True)
class ResolvedDtypeNames:
    """The concrete dtypes of a plan, by name (``config.ResolvedDtypes`` holds torch dtypes)."""

    model: str
    kv_cache: str
    conv_state: str
    ssm_state: str

    def as_names(self) -> dict[str, str]:
        return {"dtype": self.model, "kv_cache_dtype": self.kv_cache, "mamba_cache_dtype": self.conv_state,
                "mamba_ssm_cache_dtype": self.ssm_state}


@dataclass
class PlanConfig:
    """The cache-deciding engine options, checked as ``EngineConfig`` checks them; no torch needed."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    max_model_len: int | None = None
    cache_memory: int | str = "1GiB"
    block_size: int = 16
    device: str = "auto"
    cpu_kernels: bool = True
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    prefix_snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL
    speculative_config: Any = None  # as EngineConfig's: a dict, a JSON string or None
    tensor_parallel_size: int = 1  # > 1: the plan is one rank's (each rank's pool holds its slice of every cache)

    def __post_init__(self) -> None:
        self.dtype = canonical_option("dtype", self.dtype, ("auto", *MODEL_DTYPE_NAMES))
        self.kv_cache_dtype = canonical_option("kv_cache_dtype", self.kv_cache_dtype, ("auto", *KV_CACHE_DTYPE_NAMES))
        self.mamba_cache_dtype = conv_state_dtype(self.mamba_cache_dtype)
        self.mamba_ssm_cache_dtype = canonical_option("mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype,
                                                      ("auto", *TEMPORAL_STATE_DTYPE_NAMES))
        self.device = canonical_option("device", self.device, DEVICES)
        check_cache_shape_options(self)
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        for name in ("cpu_kernels", "enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        self.cache_memory = parse_size(self.cache_memory)
        parse_speculative_config(self.speculative_config)  # ValueError naming the bad key or value

    def resolve_dtypes(self, config: Any) -> ResolvedDtypeNames:
        """Every ``auto`` resolved against the checkpoint's config, as ``EngineConfig.resolve_dtypes``."""
        model = self.dtype if self.dtype != "auto" else checkpoint_dtype_name(config)
        kv = model if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        conv = model if self.mamba_cache_dtype == "auto" else self.mamba_cache_dtype
        ssm = (self.mamba_ssm_cache_dtype if self.mamba_ssm_cache_dtype != "auto"
               else checkpoint_ssm_dtype_name(config) or conv)
        return ResolvedDtypeNames(model=model, kv_cache=kv, conv_state=conv, ssm_state=ssm)

    def resolve_device(self) -> SimpleNamespace:
        """The device the engine would run on (``.type``: "cpu" or "cuda"); see :func:`cuda_available`."""
        if self.device == "auto":
            return SimpleNamespace(type="cuda" if cuda_available() else "cpu")
        if self.device == "cuda" and not cuda_available():
            raise ValueError("device='cuda' was requested but CUDA is not available; allowed here: auto, cpu")
        return SimpleNamespace(type=self.device)


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch where the answer is plain: a CPU-only torch
    build ("+cpu") or a machine with no GPU device node has no CUDA; otherwise torch is asked."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False
    if version.endswith("+cpu"):
        return False
    if not any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")):
        return False
    import torch

    return bool(torch.cuda.is_available())
