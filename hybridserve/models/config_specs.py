"""Cache specs straight from a config.json, without torch or transformers (for ``hybridserve plan``).

The engine gets its specs from the model it builds (each layer declares its own); building one needs
torch, and reading the config needs transformers' config classes, which import torch too: seconds of
imports. Here a config.json is read as plain keys and each family's record (``models/registry.py``) maps
it to the same specs with its torch-free function (``models/family_specs.py``).

Families without such a function are planned the engine's way (:func:`hybridserve.planning.planner.
cache_specs_from_config`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.models import registry
from hybridserve.models.family_specs import NEMOTRON_ALIASES, NEMOTRON_PATTERN, JsonConfig
from hybridserve.models.registry import architecture_of


def read_config(path: str) -> JsonConfig:
    """config.json of a checkpoint directory (or the file itself) as a :class:`JsonConfig`."""
    file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if os.path.isdir(path) and not os.path.isfile(file):
        raise ValueError(f"model={path!r} has no config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model={path!r} is not a directory holding a checkpoint")
    try:
        with open(file, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file!r} is not a readable JSON config: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file!r} holds {type(values).__name__}, not a JSON object")
    return JsonConfig(_served_as_text(values))


def _served_as_text(values: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config served as text (``registry.SERVED_AS_TEXT``): its ``text_config`` naming the
    architecture, with the top-level ``tie_word_embeddings`` and dtype (``loader.served_text_config``, without
    transformers). Any other config unchanged."""
    model_type = values.get("model_type")
    named = registry.model_types().get(model_type) if isinstance(model_type, str) else None
    archs = values.get("architectures") or [named]
    text = values.get("text_config") or {}
    if archs[0] not in registry.SERVED_AS_TEXT or not isinstance(text, dict):
        return values
    served = {**text, "architectures": list(archs), "tie_word_embeddings": bool(values.get("tie_word_embeddings"))}
    for key in ("dtype", "torch_dtype"):
        if values.get(key) is not None:
            served[key] = values[key]
    return served



def has_family(config: Any) -> bool:
    """Whether ``config``'s architecture is planned here (without torch)."""
    record = registry.family(architecture_of(config))
    return record is not None and record.plan_specs is not None


def config_cache_specs(config: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    """Every layer's cache spec from ``config`` alone (its family must have torch-free specs: :func:`has_family`)."""
    record = registry.family(architecture_of(config))
    if record is None or record.plan_specs is None:
        raise ValueError(f"{architecture_of(config)} has no torch-free cache specs; plan it from its model")
    return record.plan_specs(config, dtypes)


def max_positions(config: Any) -> int | None:
    """The most positions the model was trained for: ``max_position_embeddings``, or its config class's
    default when the file leaves it out; None when the family has no such bound (Mamba)."""
    value = getattr(config, "max_position_embeddings", None)
    record = registry.family(architecture_of(config))
    fixed = record.fixed_positions(config) if record is not None and record.fixed_positions is not None else None
    if fixed is not None:
        value = fixed  # the config class sets it so, whatever the file says
    if value is None:
        value = record.default_max_positions if record is not None else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


__all__ = ["NEMOTRON_ALIASES", "NEMOTRON_PATTERN", "JsonConfig", "architecture_of", "config_cache_specs",
           "has_family", "max_positions", "read_config"]
