"""What a sequence holds of the pool (:class:`CacheHolder`: page and slot handles) and the window pages a
prefix hit resumes with (:func:`window_hit`)."""

from __future__ import annotations

from typing import Protocol

from hybridserve.cache.prefix_hit import PrefixHit


class CacheHolder(Protocol):
    """What the manager needs of a sequence: its block table, its state slot (handles, stable while held)
    and how many of its tokens are in the cache (``engine.Sequence`` is one)."""

    block_table: list[int]
    window_table: list[int]  # read and written only with a window page group
    state_slot: int | None
    spec_slot: int | None  # a second slot a speculative verification runs on (None without one)
    num_computed_tokens: int


def window_hit(hit: PrefixHit, window: int, block_size: int) -> tuple[int, list[int], int | None]:
    """(first block, full pages to share, partly filled page to copy or None) of the window layers' pages a
    hit at ``hit.tokens`` resumes with: its snapshot's (``Snapshot.window_pages``)."""
    snap = hit.snapshot
    assert snap is not None, "a window page group resumes from snapshots only"
    pages = list(snap.window_pages)
    partial = pages.pop() if hit.tokens % block_size else None
    return max(0, hit.tokens - window + 1) // block_size, pages, partial

