"""Shared helpers for the op tests: caches built as strided views into a larger byte buffer."""

from __future__ import annotations

import math

import pytest
import torch

SENTINEL = 0xA5  # byte pattern of buffer bytes that belong to no view


class StridedCaches:
    """Several same-shaped caches interleaved page by page in one uint8 buffer, like a pool page
    that holds more than one tensor: slot i of view j lives at byte offset
    base + i * page + j * tensor_bytes, and `gap` elements of foreign bytes follow every slot."""

    def __init__(self, shape, dtype, n_views=1, gap=3, base=5):
        self.shape, self.dtype = tuple(shape), dtype
        es = torch.empty((), dtype=dtype).element_size()
        per = math.prod(self.shape[1:])  # elements of one slot
        self.slot_elems = per + gap  # stride between slots of one view, in elements
        self.page_elems = self.slot_elems * n_views  # one page holds a slot of every view
        self.base_elems = base
        total = (base + self.page_elems * self.shape[0] + 2) * es
        self.buf = torch.full((total,), SENTINEL, dtype=torch.uint8)  # (bytes,)
        self.owned = torch.zeros(total, dtype=torch.bool)  # bytes that belong to a view
        self.views = [self._view(j) for j in range(n_views)]
        for v in self.views:
            self.owned |= self._owned_mask(v)

    def _strides(self):
        inner = [1]
        for d in reversed(self.shape[2:]):
            inner.insert(0, inner[0] * d)
        return (self.page_elems, *inner)

    def _view(self, j):
        typed = self.buf.view(self.dtype)  # (total / es,)
        offset = self.base_elems + j * self.slot_elems
        return typed.as_strided(self.shape, self._strides(), offset)

    def _owned_mask(self, view):
        es = view.element_size()
        marker = torch.zeros(self.buf.numel() // es, dtype=torch.bool)
        marker.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
        return marker.repeat_interleave(es)

    def fresh_view(self, j=0):
        """Re-read view j from the buffer (proves writes landed in the shared bytes)."""
        return self._view(j)

    def foreign_bytes_intact(self) -> bool:
        return bool((self.buf[~self.owned] == SENTINEL).all())


@pytest.fixture
def strided_caches():
    return StridedCaches


TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


@pytest.fixture
def tol():
    """tol(dtype) -> (rtol, atol) for values stored in / computed through `dtype`."""
    return TOLERANCES.__getitem__
