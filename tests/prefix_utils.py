"""Checks shared by the prefix-caching tests: reference counts and pool holdings add up exactly."""

from __future__ import annotations

from collections import Counter


def check_cache_invariants(engine) -> None:
    """Every page's reference count is its holders (sequences' block and window tables, indexed node, snapshot
    tails and window pages); every cached page and snapshot slot is live in the pool; the pool holds nothing
    else."""
    cache, pool = engine.cache, engine.pool
    expected: Counter[int] = Counter()
    slots: Counter[int] = Counter()
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        expected.update(seq.block_table)
        expected.update(page for page in seq.window_table if page >= 0)  # -1: released behind the window
        if seq.state_slot is not None:
            slots[seq.state_slot] += 1
        if getattr(seq, "spec_slot", None) is not None:  # speculative decoding's second slot
            slots[seq.spec_slot] += 1
    prefix = cache.prefix
    if prefix is not None:
        for item in prefix.index.items():
            if hasattr(item, "slot"):
                if item.slot is not None:
                    slots[item.slot] += 1
                if item.tail_page is not None:
                    expected[item.tail_page] += 1
                expected.update(item.window_pages)
                assert item.position <= item.node.depth * item.block_size + item.block_size - 1
            elif item.page is not None:
                expected[item.page] += 1
    assert dict(expected) == cache.page_refs, "page reference counts do not match their holders"
    if prefix is not None:  # whatever nothing but the cache holds is queued for eviction at its current version
        queued = {id(entry[4]) for entry in prefix.index._heap if entry[3] == entry[4].version}
        missed = [item for item in prefix.index.items() if prefix.evictable(item) and id(item) not in queued]
        assert not missed, f"{len(missed)} evictable items are not in the eviction queue"
    assert all(count == 1 for count in slots.values()), "a state slot has two owners"
    live_pages, live_slots = pool.live_handles()  # nothing else holds any (captured steps' padded rows neither)
    assert live_pages == set(expected), "the pool's live pages are not the referenced ones"
    assert live_slots == set(slots), "the pool's live slots are not the held ones"


def assert_drained(engine) -> None:
    """After every request ended: the cache invariants hold, and evicting the prefix cache empties the pool."""
    assert not engine.has_unfinished_requests()
    check_cache_invariants(engine)
    assert engine.reset_prefix_cache()
    pool = engine.pool
    assert pool.num_live_pages == 0 and pool.num_live_slots == 0 and pool.usage() == 0.0
    assert engine.cache.page_refs == {}


def released_everything(engine) -> bool:
    """Whether, with no request left, the pool holds nothing once the prefix cache is evicted (no leak)."""
    check_cache_invariants(engine)
    if engine.has_unfinished_requests() or engine.cache.held_bytes():
        return False
    return engine.reset_prefix_cache() and engine.pool.used_bytes() == 0 and not engine.cache.page_refs
