"""The pool's id sets against a plain Python set, and the garbage collector's work on a large pool."""

from __future__ import annotations

import gc
import random
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.cache.id_set import IdSet
from hybridserve.cache.layout import compute_layout
from hybridserve.cache.manager import CacheManager
from hybridserve.cache.pool import CachePool
from hybridserve.cache.spec import AttentionSpec, LayerCacheSpec, StateTensorSpec
from hybridserve.engine.sequence import Sequence
from hybridserve.sampling_params import SamplingParams

CAPACITY = 64
operations = st.lists(st.tuples(st.sampled_from(["push", "remove", "pop", "peek"]),
                                st.integers(0, CAPACITY - 1)), max_size=300)


@settings(max_examples=200, deadline=None)
@given(operations, st.booleans(), st.sets(st.integers(0, CAPACITY - 1)))
def test_id_set_matches_a_python_set(ops, largest_first, initial):
    ids = IdSet(CAPACITY, sorted(initial), largest_first=largest_first)
    reference = set(initial)
    extreme = max if largest_first else min
    for op, i in ops:
        if op == "push":
            ids.push(i)
            reference.add(i)
        elif op == "remove":
            ids.remove(i)
            reference.discard(i)
        elif op == "pop" and reference:
            expected = extreme(reference)
            assert ids.pop() == expected
            reference.remove(expected)
        else:
            assert ids.peek() == (extreme(reference) if reference else None)
        assert len(ids) == len(reference) and bool(ids) == bool(reference)
        assert list(ids) == sorted(reference)
        assert all((j in ids) == (j in reference) for j in (i, 0, CAPACITY - 1))


def test_id_set_from_a_range_and_its_errors():
    ids = IdSet(10, range(2, 7), largest_first=True)
    assert list(ids) == [2, 3, 4, 5, 6] and ids.pop() == 6 and ids.peek() == 5
    assert -1 not in ids and 10 not in ids
    with pytest.raises(ValueError, match=r"id 10 is outside \[0, 10\)"):
        ids.push(10)
    empty = IdSet(3)
    assert empty.peek() is None and not empty
    with pytest.raises(KeyError, match="empty"):
        empty.pop()


def _gc_references(root: object) -> int:
    """References the garbage collector follows from the tracked objects ``root`` holds (its own data:
    classes, modules and functions are shared by every pool and not followed; tensors are one object)."""
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, (torch.Tensor, type, types.ModuleType,
                                                                          types.FunctionType)):
            continue
        seen.add(id(obj))
        referents = gc.get_referents(obj)
        total += len(referents)
        stack.extend(referents)
    return total


def _churned_pool(num_bytes: int) -> CachePool:
    spec = LayerCacheSpec(0, "both", AttentionSpec(1, 4, torch.float32), (StateTensorSpec("s", (4,), torch.float32),))
    pool = CachePool(compute_layout([spec], 16), num_bytes, torch.device("cpu"))
    cache = CacheManager(pool)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4)
    held = []
    for i in range(200):  # allocations and releases mixed, some left live
        seq = Sequence(f"r{i}", [1] * rng.randint(1, 80), params, i)
        assert cache.grant(seq, seq.num_tokens)
        held.append(seq)
        if rng.random() < 0.6:
            cache.release(held.pop(rng.randrange(len(held))))
    return pool


def test_the_collectors_work_on_a_pool_does_not_grow_with_its_size():
    """A pool of a thousand times more pages and slots gives the garbage collector no more to traverse:
    its free and live ids are not Python objects (a full collection over millions of them paused decode)."""
    small = _churned_pool(1 << 20)
    large = _churned_pool(1 << 30)
    assert large.num_pages > 500 * small.num_pages
    assert _gc_references(large) == _gc_references(small)
