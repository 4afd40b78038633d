"""Why a request's prompt did or did not resume from the prefix cache: one reason per lookup, decided by the
prefix cache (:meth:`hybridserve.cache.prefix_cache.PrefixCache.lookup`), kept per request
(:class:`PrefixCacheInfo`, on ``RequestOutput.prefix_cache``) and counted by reason (``/metrics``).

``salted`` (a match exists only under another ``cache_salt``) is counted, never told: a request's own answer
says ``no_match`` then, exactly what it would say if no other salt held anything (docs/prefix_caching.md).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass


class PrefixCacheReason(str, enum.Enum):
    """The outcome of one prefix-cache lookup."""

    HIT = "hit"  # resumed from cached tokens
    NO_MATCH = "no_match"  # nothing cached shares the prompt's first page
    NO_SNAPSHOT = "no_snapshot"  # KV pages matched, but no state snapshot at or before the divergence point
    EVICTED = "evicted"  # what matched (a page or a usable snapshot) was evicted recently
    SALTED = "salted"  # a match exists only under another cache_salt (counted on /metrics only)
    CACHING_OFF = "caching_off"  # the engine caches no prefixes for this model or engine
    TOO_SHORT = "too_short"  # the prompt, less its last token, is shorter than one page
    PROMPT_LOGPROBS = "prompt_logprobs"  # the request asked for prompt logprobs: every position is computed

    def told(self) -> PrefixCacheReason:
        """The reason the request itself is given: ``salted`` reads as ``no_match`` (its own salt has nothing)."""
        return PrefixCacheReason.NO_MATCH if self is PrefixCacheReason.SALTED else self


@dataclass(frozen=True)
class PrefixCacheInfo:
    """A request's prefix-cache answer: the prompt tokens it resumed from, why, and where the match ended."""

    reason: PrefixCacheReason  # as told to the request (never ``salted``)
    cached_tokens: int  # prompt tokens resumed from the cache
    matched_tokens: int = 0  # prompt tokens whose KV the cache holds (the divergence point)
    #: the latest usable state snapshot at or before the divergence point (None: none, or a model without state)
    snapshot_tokens: int | None = None
    #: ``no_snapshot``: the nearest snapshot past the divergence point on the cached branch the prompt follows
    #: (where the state was saved; None if none was found)
    snapshot_past_tokens: int | None = None

    def as_dict(self) -> dict:
        """JSON-ready fields."""
        return {"reason": self.reason.value, "cached_tokens": self.cached_tokens,
                "matched_tokens": self.matched_tokens, "snapshot_tokens": self.snapshot_tokens,
                "snapshot_past_tokens": self.snapshot_past_tokens}


class ReasonCounts:
    """Lookups and the prompt tokens they looked up, by reason (``salted`` included: these feed ``/metrics``)."""

    def __init__(self) -> None:
        self.lookups: Counter[PrefixCacheReason] = Counter()
        self.tokens: Counter[PrefixCacheReason] = Counter()

    def add(self, reason: PrefixCacheReason, num_tokens: int) -> None:
        self.lookups[reason] += 1
        self.tokens[reason] += num_tokens

    def as_stats(self) -> dict[str, int]:
        """``lookups:REASON`` and ``queries:REASON`` (tokens) for every reason, zeros included."""
        stats = {f"lookups:{r.value}": self.lookups[r] for r in PrefixCacheReason}
        stats.update({f"queries:{r.value}": self.tokens[r] for r in PrefixCacheReason})
        return stats
