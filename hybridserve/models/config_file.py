"""A checkpoint's config.json read as plain JSON, before transformers sees it (``models/config_checks.py``
checks these raw values, and a config transformers would reject gets a message naming the key)."""

from __future__ import annotations

import json
import os
from typing import Any

from hybridserve.models import registry


def read_config_values(path: str) -> dict[str, Any]:
    """config.json of a checkpoint directory (or the file itself) as a dict; a vision-language config served as
    text (``registry.SERVED_AS_TEXT``) as its ``text_config`` with the top-level ``architectures``,
    ``tie_word_embeddings`` and dtype (what ``loader.served_text_config`` makes of transformers' object)."""
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
    return _served_as_text(values)


def _served_as_text(values: dict[str, Any]) -> dict[str, Any]:
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
