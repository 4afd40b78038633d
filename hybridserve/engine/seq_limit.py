"""``max_num_seqs`` against what the cache pool can hold: clamped at start, never refused.

A running sequence holds at least its state slot and one KV page (one per page group), however short it is, so
the pool holds at most :func:`~hybridserve.cache.capacity.max_sequences` one-token sequences at once. A larger
``max_num_seqs`` could never be reached: the engine runs with that many instead (the scheduler's limit and the
captured decode steps' largest bucket), with one WARNING naming both numbers and why. Only a pool that holds not
even one sequence is an error, at start.
"""

from __future__ import annotations

import logging

from hybridserve.cache.capacity import max_sequences, sequence_pages
from hybridserve.cache.layout import PoolLayout

logger = logging.getLogger(__name__)


def fitted_max_num_seqs(requested: int, layout: PoolLayout, pool_bytes: int) -> int:
    """``requested``, or the most sequences a pool of ``pool_bytes`` holds at once when that is fewer (logged as
    one WARNING). Raises ValueError when the pool holds no sequence at all."""
    smallest = smallest_sequence_bytes(layout)
    fits = max_sequences(layout, pool_bytes, 1)
    if fits < 1:
        raise ValueError(f"cache_memory={pool_bytes} bytes holds no sequence: one needs at least {smallest} bytes "
                         f"({_what_a_sequence_holds(layout)}); raise --cache-memory")
    if requested <= fits:
        return requested
    logger.warning("max_num_seqs=%d (--max-num-seqs) is more than the cache pool can hold at once: clamped to %d "
                   "(a sequence holds at least %d bytes: %s; cache_memory=%d bytes); raise --cache-memory to run "
                   "more at once",
                   requested, fits, smallest, _what_a_sequence_holds(layout), pool_bytes)
    return fits


def smallest_sequence_bytes(layout: PoolLayout) -> int:
    """Pool bytes a one-token sequence holds: its state slot and a page of each page group."""
    return (layout.slot_bytes if layout.has_state else 0) + sequence_pages(layout, 1) * layout.page_bytes


def _what_a_sequence_holds(layout: PoolLayout) -> str:
    parts = []
    if layout.has_state:
        parts.append(f"state {layout.state_bytes_per_sequence} bytes in a {layout.slot_bytes}-byte slot")
    pages = sequence_pages(layout, 1)
    if pages:
        parts.append(f"{pages} KV page{'s' if pages > 1 else ''} of {layout.page_bytes} bytes")
    return " and ".join(parts)
