"""Engine options: one validated dataclass, dtype resolution and the config fingerprint.

The four dtype knobs (docs/dtypes.md):

* ``dtype``: weights and activations; ``auto`` is the checkpoint's ``dtype``/``torch_dtype``
  (float32 when absent).
* ``kv_cache_dtype``: attention K and V; ``auto`` is the model dtype.
* ``mamba_cache_dtype``: conv states; ``auto`` is the model dtype.
* ``mamba_ssm_cache_dtype``: recurrent ("temporal") states; ``auto`` is a dtype the checkpoint
  declares (``mamba_ssm_cache_dtype`` or ``mamba_ssm_dtype``), else the resolved conv-state dtype;
  ``int8`` and ``fp8_e4m3`` store 8-bit codes and a bfloat16 scale per state row (docs/state_precision.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridserve.cache.dtypes import dtype_name
from hybridserve.cache.spec import ResolvedDtypes
from hybridserve.generation_config import check_generation_config_setting
from hybridserve.kernels.isa import CPU_ISA_CHOICES
from hybridserve.kernels.threads import check_thread_options, check_wait_policy
from hybridserve.options import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS,
    DEFAULT_SNAPSHOT_INTERVAL,
    DTYPE_ALIASES,
    INT4_GROUP_SIZES,
    QUANTIZATIONS,
    check_cache_shape_options,
    check_positive_int,
    conv_state_dtype,
    parse_cache_bytes,
    parse_size,
)
from hybridserve.spec_decode.config import parse_speculative_config
from hybridserve.structured_output.limits import GrammarLimits

# re-exported: callers import these from here
__all__ = ["DEVICES", "FP8_KV_DTYPES", "INT8_QUANTIZATIONS", "KV_CACHE_DTYPES", "MODEL_DTYPES", "QUANTIZATIONS",
           "STATE_DTYPES", "TEMPORAL_STATE_DTYPES", "EngineConfig", "ResolvedDtypes", "check_tensor_parallel_options",
           "checkpoint_dtype", "checkpoint_ssm_dtype", "dtype_name", "parse_size"]

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    **MODEL_DTYPES,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
STATE_DTYPES: dict[str, torch.dtype] = dict(MODEL_DTYPES)
#: what ``mamba_cache_dtype`` takes besides ``auto``: the float state dtypes and int8 (cache/conv_codec.py)
CONV_STATE_DTYPES: dict[str, torch.dtype] = {**STATE_DTYPES, "int8": torch.int8}
#: what ``mamba_ssm_cache_dtype`` takes: the float state dtypes and the code dtypes of 8-bit state
TEMPORAL_STATE_DTYPES: dict[str, torch.dtype] = {**STATE_DTYPES, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
#: KV-cache dtypes stored scaled (value / scale), with the checkpoint's k/v scales where it has them
FP8_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
DEVICES = ("auto", "cpu", "cuda")
#: weight quantization: auto (a checkpoint's own fp8 weights as they are, else none), none (fp8 weights
#: dequantized at load), int8 (every linear made int8 at load, fp8 ones kept), w8a8 (int8 as well, and the
#: linears' activations quantized to int8 per row at every call), int4 (every linear made 4-bit at load, a float16
#: scale per group of in-features): QUANTIZATIONS in options.py, docs/quantization.md
#: the quantizations that make linears int8 at load
INT8_QUANTIZATIONS = ("int8", "w8a8")
#: the quantizations made at load, on hybridserve's compiled CPU kernels
LOAD_QUANTIZATIONS = (*INT8_QUANTIZATIONS, "int4")


_DTYPE_ALIASES = DTYPE_ALIASES


def _check_group_size(quantization: str, group: int | None) -> int | None:
    """``quantization_group_size`` resolved: with ``quantization="int4"`` one of INT4_GROUP_SIZES (None: the
    default), otherwise None."""
    if group is None:
        return DEFAULT_INT4_GROUP_SIZE if quantization == "int4" else None
    if quantization != "int4":
        raise ValueError(f"quantization_group_size={group!r} (--quantization-group-size) applies to "
                         f"quantization='int4' only, got quantization={quantization!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size={group!r} (--quantization-group-size) must be one of "
                         f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    return group


def _check_choice(option: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        if isinstance(value, torch.dtype):
            value = dtype_name(value)
        else:
            raise ValueError(f"{option}={value!r} is not valid; allowed values: {', '.join(allowed)}")
    canonical = _DTYPE_ALIASES.get(value.lower(), value.lower())
    if canonical not in allowed:
        raise ValueError(f"{option}={value!r} is not valid; allowed values: {', '.join(allowed)}")
    return canonical


# EngineConfig fields that change speed or output, never results: left out of the fingerprint.
NO_EFFECT_ON_RESULTS = ("enable_progress_bar", "cpu_weight_prepack", "enforce_eager", "cpu_wait_policy",
                        "max_grammar_bytes", "max_grammar_compile_seconds", "grammar_cache_bytes")
# (cpu_isa and cpu_kernels stay in it: the kernel variants round in their own orders.)


@dataclass
class EngineConfig:
    """Every option of the engine, validated on construction.

    ``model`` is a checkpoint directory. ``cache_memory`` is the byte budget of the one cache pool
    that holds attention KV and recurrent state together.
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cache_memory: int | str = "1GiB"
    block_size: int = 16
    device: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    enable_progress_bar: bool = True
    cpu_weight_prepack: bool = True
    cpu_kernels: bool = True
    enforce_eager: bool = False
    cpu_isa: str = "auto"
    # CPU threads (kernels/threads.py): None is auto (every usable core, less the reserved ones); the OpenMP
    # wait policy takes effect only where it is set before torch is imported (the hybridserve command does)
    cpu_threads: int | None = None
    cpu_reserved_cores: int = 0
    cpu_wait_policy: str = "auto"
    # fewer threads while other processes take the cores (kernels/thread_share.py); cpu_threads is the ceiling
    cpu_adaptive_threads: bool = False
    quantization: str = "auto"
    # in-features per scale of quantization="int4" (None: DEFAULT_INT4_GROUP_SIZE; other quantizations take none)
    quantization_group_size: int | None = None
    enable_prefix_caching: bool = True
    prefix_snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL
    speculative_config: dict[str, Any] | str | None = None
    tensor_parallel_size: int = 1
    # structured output's grammar limits (structured_output/limits.py, docs/structured_output.md)
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    max_grammar_compile_seconds: float = DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS
    grammar_cache_bytes: int | str = DEFAULT_GRAMMAR_CACHE_BYTES
    # where requests' sampling defaults come from: auto (the model's generation_config.json), vllm (none) or a
    # folder (hybridserve/generation_config.py)
    generation_config: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = _check_choice("dtype", self.dtype, ("auto", *MODEL_DTYPES))
        self.kv_cache_dtype = _check_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", *KV_CACHE_DTYPES))
        self.mamba_cache_dtype = conv_state_dtype(
            dtype_name(self.mamba_cache_dtype) if isinstance(self.mamba_cache_dtype, torch.dtype)
            else self.mamba_cache_dtype)
        self.mamba_ssm_cache_dtype = _check_choice(
            "mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype, ("auto", *TEMPORAL_STATE_DTYPES))
        self.device = _check_choice("device", self.device, DEVICES)
        self.cpu_isa = _check_choice("cpu_isa", self.cpu_isa, CPU_ISA_CHOICES)
        self.cpu_threads, self.cpu_reserved_cores = check_thread_options(self.cpu_threads, self.cpu_reserved_cores)
        self.cpu_wait_policy = check_wait_policy(self.cpu_wait_policy)
        self.quantization = _check_choice("quantization", "none" if self.quantization is None else self.quantization,
                                          QUANTIZATIONS)
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            check_positive_int(name, getattr(self, name))
        check_cache_shape_options(self)
        for name in ("cpu_weight_prepack", "cpu_kernels", "enforce_eager", "enable_progress_bar",
                     "enable_prefix_caching", "cpu_adaptive_threads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        self.cache_memory = parse_size(self.cache_memory)
        self.generation_config = check_generation_config_setting(self.generation_config)
        parse_speculative_config(self.speculative_config)  # ValueError naming the bad key or value
        self.grammar_cache_bytes = parse_cache_bytes(self.grammar_cache_bytes)
        self.grammar_limits()  # ValueError naming a bad limit
        if self.tensor_parallel_size > 1:
            check_tensor_parallel_options(self)
            if self.cpu_adaptive_threads:
                raise ValueError(f"cpu_adaptive_threads=True runs in one process; with tensor_parallel_size="
                                 f"{self.tensor_parallel_size} the ranks would count each other as other processes "
                                 f"(allowed: cpu_adaptive_threads=False, or tensor_parallel_size=1)")
        self.quantization_group_size = _check_group_size(self.quantization, self.quantization_group_size)
        if self.quantization in LOAD_QUANTIZATIONS and (not self.cpu_kernels or self.device == "cuda"):
            raise ValueError(f"quantization={self.quantization!r} runs on hybridserve's compiled CPU kernels: it needs "
                             f"cpu_kernels=True and device cpu or auto (got cpu_kernels={self.cpu_kernels}, "
                             f"device={self.device!r})")

    def int4_group_size(self) -> int:
        """In-features per scale of ``quantization="int4"``."""
        return self.quantization_group_size or DEFAULT_INT4_GROUP_SIZE

    def grammar_limits(self) -> GrammarLimits:
        """Structured output's limits on a request's grammar (size, compile time) and on the compiled-grammar cache."""
        assert isinstance(self.grammar_cache_bytes, int)  # (made bytes in __post_init__)
        return GrammarLimits(self.max_grammar_bytes, self.max_grammar_compile_seconds, self.grammar_cache_bytes)

    def resolve_device(self) -> torch.device:
        """The torch device: ``auto`` picks CUDA when available."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available; allowed here: auto, cpu")
        return torch.device(self.device)

    def resolve_dtypes(self, hf_config: Any) -> ResolvedDtypes:
        """Resolve every ``auto`` against the checkpoint's config (docs/dtypes.md)."""
        model = MODEL_DTYPES[self.dtype] if self.dtype != "auto" else checkpoint_dtype(hf_config)
        kv = model if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]
        conv = model if self.mamba_cache_dtype == "auto" else CONV_STATE_DTYPES[self.mamba_cache_dtype]
        if self.mamba_ssm_cache_dtype != "auto":
            ssm = TEMPORAL_STATE_DTYPES[self.mamba_ssm_cache_dtype]
        else:
            ssm = checkpoint_ssm_dtype(hf_config) or conv
        return ResolvedDtypes(model=model, kv_cache=kv, conv_state=conv, ssm_state=ssm)

    def fingerprint(self, resolved: ResolvedDtypes | None = None) -> str:
        """A short hash over every field that changes results (and the resolved dtypes)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in NO_EFFECT_ON_RESULTS}
        if resolved is not None:
            fields["resolved"] = resolved.as_names()
        blob = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_tensor_parallel_options(config: EngineConfig) -> None:
    """The options tensor parallelism (docs/tensor_parallel.md) cannot run with: ValueError naming them."""
    size = config.tensor_parallel_size
    if config.device == "cuda":
        raise ValueError(f"tensor_parallel_size={size} runs on the CPU (gloo); got device='cuda' (allowed: auto, cpu)")


def _dtype_from_config_value(value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value if value in MODEL_DTYPES.values() else None
    name = _DTYPE_ALIASES.get(str(value).lower().removeprefix("torch."), str(value).lower().removeprefix("torch."))
    return MODEL_DTYPES.get(name)


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The checkpoint's declared weight dtype, float32 when it declares none."""
    for key in ("dtype", "torch_dtype"):
        found = _dtype_from_config_value(getattr(hf_config, key, None))
        if found is not None:
            return found
    return torch.float32


def checkpoint_ssm_dtype(hf_config: Any) -> torch.dtype | None:
    """A recurrent-state dtype declared by the checkpoint (``mamba_ssm_cache_dtype``/``mamba_ssm_dtype``)."""
    for key in ("mamba_ssm_cache_dtype", "mamba_ssm_dtype"):
        value = getattr(hf_config, key, None)
        if value in (None, "auto"):
            continue
        found = _dtype_from_config_value(value)
        if found is not None:
            return found
    return None
