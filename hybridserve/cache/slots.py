"""Reading and writing the state slots of a batch of sequences.

``index_select`` / ``index_copy_`` on the pool's strided views are several times faster on the CPU
than advanced indexing (``cache[idx]``, ``cache[idx] = ...``), which takes the general gather/scatter
path.
"""

from __future__ import annotations

import torch


def read_slots(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cache: (num_slots, *shape) in the cache dtype; idx: (B,) int64 -> a new float32 (B, *shape)."""
    return cache.index_select(0, idx).float()


def write_slots(cache: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Store values (B, *shape) into cache[idx], cast to the cache dtype, in place (distinct idx)."""
    cache.index_copy_(0, idx, values.to(cache.dtype))
