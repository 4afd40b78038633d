"""Checks on a checkpoint's config.json values before anything is built from them.

transformers' config classes take most values as they come: a zero head count divides by zero when the
model is built, a string size or an unknown dtype fails deep inside transformers, and a layer count of a
million keeps the config class (and the model construction after it) busy for minutes before memory runs
out. :func:`check_config_values` refuses those with one-line ValueErrors naming the key, the value and
what is allowed, reading the raw JSON (so it needs neither torch nor transformers), in well under a
second: sizes and counts must be integers (positive for the ones a model divides by or allocates with),
a declared dtype must be a known one, and the weights the sizes imply (a lower bound:
:func:`estimated_parameters`) must fit in the memory available.
"""

from __future__ import annotations

import os
import re
from typing import Any

#: keys that must be positive integers where present (a model divides by them or sizes its weights with them)
POSITIVE_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "intermediate_size", "head_dim", "max_position_embeddings",
    "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_d_conv", "mamba_n_groups", "mamba_expand",
    "mamba_chunk_size", "mamba_num_heads", "mamba_head_dim", "state_size", "ssm_state_size", "conv_kernel",
    "n_groups", "expand", "chunk_size", "num_heads", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
})
#: other keys naming a size or a count: integers, zero allowed (``num_local_experts: 0`` is a dense model)
COUNT_KEY = re.compile(r"^(num_\w+|n_\w+|\w+_size|\w+_heads|\w+_dim|d_\w+|\w+_layers|\w+_experts)$")
#: the dtype names a config.json may declare for its weights (``dtype``, or the older ``torch_dtype``)
CONFIG_DTYPES = ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2",
                 "float", "fp32", "bf16", "half", "fp16", "auto")
#: where a config.json gives its layer count: a number, or one entry per layer
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
LAYER_LIST_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern")


def check_config_values(values: dict[str, Any], file: str, check_memory: bool = True) -> None:
    """ValueError (one line, naming ``file``, the key and the allowed values) for the first bad size, count
    or dtype in a config.json's ``values`` (its ``text_config`` too), or, with ``check_memory``, for sizes whose
    weights would not fit in the memory available here."""
    for scope, table in _scopes(values):
        for key, value in table.items():
            _check_count(key, value, f"{file}: {scope}{key}")
        for key in ("dtype", "torch_dtype"):
            _check_dtype(table.get(key), f"{file}: {scope}{key}")
    if check_memory:
        _check_memory(values, file)


def _scopes(values: dict[str, Any]):
    yield "", values
    if isinstance(values.get("text_config"), dict):
        yield "text_config.", values["text_config"]


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(key: str, value: Any, where: str) -> None:
    if key in POSITIVE_KEYS and value is not None:
        if not _is_integer(value) or value < 1:
            raise ValueError(f"{where}={value!r} must be a positive integer")
    elif COUNT_KEY.match(key) and isinstance(value, (str, float)):
        raise ValueError(f"{where}={value!r} must be an integer")
    elif COUNT_KEY.match(key) and _is_integer(value) and value < 0:
        raise ValueError(f"{where}={value!r} must not be negative")


def _check_dtype(value: Any, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, str) or value.lower().removeprefix("torch.") not in CONFIG_DTYPES:
        raise ValueError(f"{where}={value!r} is not a dtype this engine knows; allowed values: "
                         f"{', '.join(CONFIG_DTYPES)}")


def layer_count(values: dict[str, Any]) -> int | None:
    """The number of layers a config.json's ``values`` give (the largest of its count and its per-layer lists)."""
    counts = [values[k] for k in LAYER_COUNT_KEYS if _is_integer(values.get(k))]
    counts += [len(values[k]) for k in LAYER_LIST_KEYS if isinstance(values.get(k), (list, str))]
    return max(counts) if counts else None


def estimated_parameters(values: dict[str, Any]) -> int | None:
    """A lower bound on the parameters of the model a config.json's ``values`` describe (its ``text_config`` for a
    vision-language one): the token embedding (vocab_size x hidden_size) and, per layer, two hidden_size x
    hidden_size projections (every family's layers hold more: attention its q and o projections, a recurrent
    mixer its in and out projections, an MLP two of hidden_size x intermediate_size). None when a size is not
    given (a config class default then applies)."""
    table = values["text_config"] if isinstance(values.get("text_config"), dict) else values
    hidden, vocab, layers = table.get("hidden_size"), table.get("vocab_size"), layer_count(table)
    if not (_is_integer(hidden) and _is_integer(vocab) and layers):
        return None
    return vocab * hidden + layers * 2 * hidden * hidden


def available_memory() -> int | None:
    """Bytes of memory this process can still use: the system's available memory, or less under a cgroup
    limit; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            pass
    return min(found) if found else None


def _check_memory(values: dict[str, Any], file: str) -> None:
    params = estimated_parameters(values)
    available = available_memory()
    if params is None or available is None:
        return
    # the smallest dtype a weight is held in: fp8 for an fp8 checkpoint's linears, else 16 bits
    per_param = 1 if isinstance(values.get("quantization_config"), dict) else 2
    need = params * per_param
    if need > available:
        table = values["text_config"] if isinstance(values.get("text_config"), dict) else values
        raise ValueError(f"{file}: the weights of {layer_count(table)} layers of hidden_size={table['hidden_size']} "
                         f"and vocab_size={table['vocab_size']} need at least {_gib(need)} ({params:,} parameters "
                         f"at {per_param} bytes), more than the {_gib(available)} of memory available")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
