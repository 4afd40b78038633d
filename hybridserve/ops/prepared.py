"""Parameters in the form a kernel takes (float32, tap-major, ...), built once per layer and kept on it.

A kernel body often wants a layer's parameters transformed (``-exp(A_log)`` in float32, a conv weight tap-major);
:func:`prepared` builds that form on first use and keeps it on the layer, rebuilt when one of the parameters'
storage changes (a weight reload). The captured decode step (``kernels/graph.py``) replays calls on these same
tensors, so they must outlive the call that built them: they do, held by the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def prepared(owner: object, name: str, sources: tuple[torch.Tensor | None, ...], build: Callable[[], T],
             *extra_key: object) -> T:
    """``build()``, kept on ``owner`` under ``name`` while the storages of ``sources`` (and ``extra_key``, e.g. a
    dtype) stay the same."""
    key = (*(None if t is None else t.data_ptr() for t in sources), *extra_key)
    held = owner.__dict__.get(name)
    if held is None or held[0] != key:
        held = (key, build())
        owner.__dict__[name] = held
    return held[1]
