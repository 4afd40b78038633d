"""The small trained hybrid model shipped with the package (used when no model is named)."""

from __future__ import annotations

import os


def default_model_path() -> str:
    """Directory of the shipped checkpoint."""
    path = os.path.dirname(os.path.abspath(__file__))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError("no model was named and the shipped default model is missing; pass --model DIR")
    return path
