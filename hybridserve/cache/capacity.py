"""The pool's exact arithmetic: how many pages and slots a byte budget holds, and what fits.

One set of functions, used by the pool when it allocates, by the engine when it validates a
request and by the planner when it reports capacity, so that every figure is the engine's own.

A pool of ``num_bytes`` is a grid of KV pages (page ``b`` at byte ``b * page_bytes``) and, over
the same bytes, a grid of state slots (slot ``s`` at byte ``s * slot_bytes``); slots are used
from the bottom and pages from the top. Because the pool can compact (move live pages up and live
slots down, see :mod:`hybridserve.cache.pool`), ``live_slots`` slots and ``live_pages`` pages fit
together exactly when the densest arrangement fits::

    live_slots * slot_bytes  <=  (num_pages - live_pages) * page_bytes

With a window page group (:mod:`hybridserve.cache.layout`), a sequence of ``n`` tokens holds its full
layers' pages for all ``n`` and its window layers' pages for the last ``window`` tokens alone
(:func:`window_pages`): the planner's figures count the window, not the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.cache.layout import ALIGN, PoolLayout


@dataclass(frozen=True)
class PoolGeometry:
    """The grids a byte budget gives: usable bytes, page count, slot count."""

    num_bytes: int  # the budget rounded down to ALIGN
    num_pages: int  # KV pages on the page grid (0 without attention)
    num_slots: int  # state slots on the slot grid (0 without state)


def pool_geometry(layout: PoolLayout, cache_memory: int) -> PoolGeometry:
    """The grids of a pool of ``cache_memory`` bytes."""
    num_bytes = cache_memory // ALIGN * ALIGN
    num_pages = num_bytes // layout.page_bytes if layout.has_kv else 0
    num_slots = num_bytes // layout.slot_bytes if layout.has_state else 0
    return PoolGeometry(num_bytes, num_pages, num_slots)


def pages_for(layout: PoolLayout, num_tokens: int) -> int:
    """KV pages that hold ``num_tokens`` tokens (0 for a model without attention)."""
    return -(-num_tokens // layout.block_size) if layout.has_kv else 0


def window_pages(layout: PoolLayout, num_tokens: int) -> int:
    """Window-group pages a decoding sequence of ``num_tokens`` tokens holds: those holding its last
    ``window`` positions, at most ``ceil((window - 1) / block_size) + 1`` (0 without a window group)."""
    if layout.window is None:
        return 0
    return min(pages_for(layout, num_tokens), -(-(layout.window - 1) // layout.block_size) + 1)


def sequence_pages(layout: PoolLayout, num_tokens: int) -> int:
    """KV pages of both groups a decoding sequence of ``num_tokens`` tokens holds."""
    return pages_for(layout, num_tokens) + window_pages(layout, num_tokens)


def fits(layout: PoolLayout, geometry: PoolGeometry, num_pages: int, num_slots: int) -> bool:
    """Whether ``num_pages`` pages and ``num_slots`` slots can all be live at once (after compaction)."""
    if num_pages < 0 or num_slots < 0:
        return False
    if num_pages and not layout.has_kv or num_slots and not layout.has_state:
        return False
    if not layout.has_kv:
        return num_slots <= geometry.num_slots
    if num_pages > geometry.num_pages:
        return False
    return num_slots * layout.slot_bytes <= (geometry.num_pages - num_pages) * layout.page_bytes


def bytes_per_sequence(layout: PoolLayout, num_tokens: int) -> int:
    """Pool bytes one sequence of ``num_tokens`` tokens holds: its slot plus its pages (both groups)."""
    return layout.slot_bytes + sequence_pages(layout, num_tokens) * layout.page_bytes


def ideal_bytes_per_sequence(layout: PoolLayout, num_tokens: int) -> int:
    """The floor no layout can beat: exact state bytes plus exact KV bytes of ``num_tokens`` tokens (of the
    last ``window`` tokens for the window group's layers)."""
    window_kv = layout.window_kv_bytes_per_token
    kv = num_tokens * (layout.kv_bytes_per_token - window_kv)
    if window_kv:
        assert layout.window is not None, "window-group KV without a window"
        kv += min(num_tokens, layout.window) * window_kv
    return layout.state_bytes_per_sequence + kv


def max_sequences(layout: PoolLayout, cache_memory: int, num_tokens: int) -> int:
    """How many sequences of ``num_tokens`` tokens fit in a pool of ``cache_memory`` bytes at once (nothing
    else holds any of it: captured decode steps pad their batches with rows that hold no page and no slot).

    The largest ``n`` with ``fits(n * pages_for(num_tokens), n)``, in closed form
    ``n * (slot_bytes + P * page_bytes) <= num_pages * page_bytes`` for a hybrid model.
    """
    geometry = pool_geometry(layout, cache_memory)
    if not layout.has_kv:
        return geometry.num_slots
    per_seq = bytes_per_sequence(layout, num_tokens)
    if per_seq == 0:
        return 0
    n = geometry.num_pages * layout.page_bytes // per_seq
    pages = sequence_pages(layout, num_tokens)
    slots = 1 if layout.has_state else 0
    while n > 0 and not fits(layout, geometry, n * pages, n * slots):
        n -= 1
    return n
