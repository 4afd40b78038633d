"""What a prefix-cache lookup returns (:class:`PrefixHit`) and the prefix cache's counters (:class:`PrefixStats`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.cache.prefix_index import PageNode, Snapshot
from hybridserve.cache.prefix_reason import PrefixCacheReason


@dataclass
class PrefixHit:
    """What a new sequence resumes from: ``tokens`` cached tokens, and where their cache is."""

    tokens: int
    shared: list[PageNode]  # the full pages it shares (tokens // block_size of them)
    tail: PageNode | Snapshot | None  # holder of the partly used page to copy (None if tokens % bs == 0)
    snapshot: Snapshot | None  # the state to copy (models with recurrent state)
    kv_tokens: int = 0  # tokens whose KV matched (the divergence point)
    num_tokens: int = 0  # tokens looked up
    reason: PrefixCacheReason = PrefixCacheReason.NO_MATCH  # why it hit or not (set by the lookup)
    snapshot_past: int | None = None  # no_snapshot: the nearest snapshot past the divergence point (PrefixIndex)

    def tail_page(self) -> int | None:
        """The page to copy on write (a handle), or None."""
        if self.tail is None:
            return None
        return self.tail.tail_page if isinstance(self.tail, Snapshot) else self.tail.page

    def snapshots(self) -> list[Snapshot]:
        """The snapshots an attach reads: the state's, and a KV tail's holder if another."""
        found = [] if self.snapshot is None else [self.snapshot]
        if isinstance(self.tail, Snapshot) and self.tail is not self.snapshot:
            found.append(self.tail)
        return found


@dataclass
class PrefixStats:
    """Counters of the prefix cache (tokens for queries and hits, as vLLM counts them)."""

    queries: int = 0  # tokens of the sequences looked up
    hits: int = 0  # of those, tokens resumed from the cache
    kv_beyond_snapshot: int = 0  # lookups whose KV matched further than any usable state snapshot
    snapshots_taken: int = 0
    snapshots_skipped: int = 0  # a snapshot was due but the pool held nothing of lower value to evict
    evicted_pages: int = 0
    evicted_snapshots: int = 0
