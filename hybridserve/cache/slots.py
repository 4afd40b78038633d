"""Reading and writing the state slots of a batch of sequences.

Slots are handed out lowest id first, so the sequences of a batch often hold a run of consecutive
slots: then the slots are one slice of the pool's view and a read or write is a single pass that also
converts the dtype. Otherwise ``index_select`` / ``index_copy_`` are used, which on the pool's strided
views are several times faster on the CPU than advanced indexing (``cache[idx]``).

A negative slot is a padding row of a captured step (``engine/decode_capture.py``), as in the kernels: it
has no state, so it reads as zeros and its writes go nowhere.
"""

from __future__ import annotations

import torch


def _consecutive(idx: torch.Tensor) -> slice | None:
    """``slice(a, a + n)`` when idx (n,) on the CPU is a, a+1, ..., a+n-1; else None."""
    n = idx.numel()
    if n == 0 or idx.device.type != "cpu":
        return None
    first = int(idx[0])
    if first < 0 or int(idx[-1]) - first != n - 1 or (n > 2 and not bool((idx[1:] - idx[:-1] == 1).all())):
        return None
    return slice(first, first + n)


def read_slots(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cache: (num_slots, *shape) in the cache dtype; idx: (B,) int64 -> a new float32 (B, *shape)."""
    run = _consecutive(idx)
    if run is not None:
        return cache[run].to(torch.float32, copy=True)
    padding = idx < 0  # (B,)
    if bool(padding.any()):
        values = cache.index_select(0, idx.clamp(min=0)).float()
        values[padding] = 0.0
        return values
    return cache.index_select(0, idx).float()


class CodedSlots:
    """What the two 8-bit state views (``cache/state_codec.py: CodedState``, ``cache/conv_codec.py:
    CodedConvState``) share: ``codes`` (slots, *shape) and ``scale`` in the pool, and reading a batch's slots
    decoded (zeros for a padded row's negative slot) through the view's own ``decode_slots``."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def decode_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots (B,) int64, all >= 0, decoded -> a new float32 (B, *shape)."""
        raise NotImplementedError

    def read(self, idx: torch.Tensor) -> torch.Tensor:
        """The slots idx (B,) int64 decoded -> a new float32 (B, *shape); zeros for a negative slot (a padded
        row of a captured step)."""
        padding = idx < 0  # (B,)
        if not bool(padding.any()):
            return self.decode_slots(idx)
        values = self.decode_slots(idx.clamp(min=0))
        return values.masked_fill_(padding.view(-1, *([1] * (values.dim() - 1))), 0.0)


def write_slots(cache: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Store values (B, *shape) into cache[idx], cast to the cache dtype, in place (distinct idx; none for a
    negative one)."""
    run = _consecutive(idx)
    if run is not None:
        cache[run].copy_(values)
        return
    kept = idx >= 0  # (B,)
    if not bool(kept.all()):
        idx, values = idx[kept], values[kept]
    cache.index_copy_(0, idx, values.to(cache.dtype))


def read_slot(cache: torch.Tensor, slot: int) -> torch.Tensor:
    """One sequence's state cache[slot] (*shape) as a new float32 tensor; zeros for a negative slot."""
    if slot < 0:
        return torch.zeros(cache.shape[1:], dtype=torch.float32, device=cache.device)
    return cache[slot].float()


def write_slot(cache: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    """Store one sequence's state ``value`` into cache[slot] in the cache dtype; nothing for a negative slot."""
    if slot >= 0:
        cache[slot] = value.to(cache.dtype)
