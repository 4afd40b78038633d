"""Requests that arrive together and share a prefix: one computes it, the others resume from it.

A prefix is only cached once some request has computed it, so requests admitted in the same step would
each compute a shared system prompt in full. Instead, when a request is admitted, the prompts queued
behind it are compared with its own: where one shares at least :data:`MIN_SHARED_TOKENS` tokens with it,
the admitted request (the *leader*) plans a state snapshot at the divergence point, so its prefill
chunk ends there; and a queued request that shares a prefix with a leader that has not reached its
planned snapshot yet waits (:func:`waits_for_leader`), to resume from it a step later instead of
computing the prefix again. Only the queued prompts near the front are compared
(:data:`MAX_COMPARED`), and a leader plans at most :data:`MAX_BRANCH_POINTS` such points (the most shared).
Only requests with the same cache salt are compared (:mod:`hybridserve.cache.salt`): a request never plans a
snapshot where another tenant's prompt leaves its own, nor waits for another tenant's request.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice

#: shorter shared prefixes are recomputed rather than waited for
MIN_SHARED_TOKENS = 32
#: queued requests compared with an admitted one (those nearest the front of the queue)
MAX_COMPARED = 128
#: divergence points one leader plans for its followers
MAX_BRANCH_POINTS = 2


def shared_tokens(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``, short of the end of either (its last token always runs)."""
    limit = min(len(a), len(b)) - 1
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def follower_branch_points(leader, queued, start: int) -> list[int]:
    """Positions past ``start`` where queued prompts leave ``leader``'s: the most shared ones, at most
    :data:`MAX_BRANCH_POINTS`, each at least :data:`MIN_SHARED_TOKENS` into the prompt."""
    prompt = leader.prompt_token_ids
    counts: Counter[int] = Counter()
    for other in islice(queued, MAX_COMPARED):
        if other is leader or other.num_computed_tokens or not other.prompt_token_ids \
                or other.prompt_token_ids[0] != prompt[0] or other.params.cache_salt != leader.params.cache_salt:
            continue
        n = shared_tokens(prompt, other.prompt_token_ids)
        if n >= MIN_SHARED_TOKENS and n > start:
            counts[n] += 1
    return [point for point, _ in counts.most_common(MAX_BRANCH_POINTS)]


def waits_for_leader(seq, running) -> bool:
    """Whether ``seq`` (queued, holding nothing) shares its prompt with a running request that has a snapshot
    planned inside that shared prefix and not reached yet: it then waits to resume from that snapshot."""
    if seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
        return False
    prompt = seq.prompt_token_ids
    for leader in running:
        done = leader.num_computed_tokens
        pending = [p for p in leader.snapshot_plan if p > done and p >= MIN_SHARED_TOKENS]
        if not pending or leader.prompt_token_ids[0] != prompt[0] \
                or leader.params.cache_salt != seq.params.cache_salt:
            continue
        shared = shared_tokens(leader.prompt_token_ids, prompt)
        if any(p <= shared for p in pending):
            return True
    return False
