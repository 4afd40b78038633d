"""Parallel sampling (``n > 1``): the prompt is prefilled once, then the request forks.

A request with ``n > 1`` enters the engine as one sequence (index 0). In the step where its prompt
has been prefilled and it samples its first token, :func:`make_children` creates its ``n - 1``
children (indices 1..n-1), and the engine registers all of them before :func:`place_children` grants
any cache, so a fork is whole or not at all. Each child gets the parent's cache, the KV of every prompt token and
the recurrent state after the prompt (:func:`copy_cache`), and samples its
first token from the parent's logits row with its own generator; from then on every child decodes
independently.

The prompt's full pages are **shared**, by reference count: nobody writes into a full page again,
so the children and the parent read the same bytes, and ``n`` completions of a long prompt hold its KV
once. The partly filled last page and the recurrent state are copied (both are written at the next
token): one page and one slot per child, each one memcpy inside the pool buffer.

A child that cannot be forked at that moment (the pool is full, ``max_num_seqs`` sequences are
running, or the request has its fair share of them while others wait: ``engine/fair_share.py``) is
queued instead and later prefills the prompt itself, exactly like a preempted sequence: slower,
never wrong.

Seeds: with ``seed=s``, child ``i`` samples with seed ``s + i`` (the parent with ``s``), so the ``n``
completions differ from each other and the whole request is reproducible.
"""

from __future__ import annotations

import copy

from hybridserve.cache.manager import CacheManager
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.sequence import Sequence
from hybridserve.sampling_params import SamplingParams


def wants_fork(seq: Sequence) -> bool:
    """Whether ``seq`` is a parent about to sample its first token with children still to create."""
    return seq.params.n > 1 and seq.index == 0 and not seq.output_token_ids


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling params of child ``index``: the parent's, with seed ``seed + index`` when seeded (the
    parent's validation covered ``seed + n - 1``)."""
    if params.seed is None:
        return params
    child = copy.copy(params)
    child.seed = params.seed + index
    return child


def make_children(parent: Sequence) -> list[Sequence]:
    """The ``n - 1`` children of ``parent`` (indices 1..n-1), holding nothing yet.

    Building them grants no cache and touches no queue, so if it raises nothing is half done; the
    engine registers all of them before any is placed (:func:`place_children`).
    """
    children: list[Sequence] = []
    for index in range(1, parent.params.n):
        child = Sequence(parent.request_id, parent.prompt_token_ids, child_params(parent.params, index),
                         parent.arrival, parent.prompt, parent.eos_token_ids, index=index, origin=parent.origin)
        child.prompt_logprobs = list(parent.prompt_logprobs)  # the prompt is shared: computed once
        children.append(child)
    return children


def place_children(parent: Sequence, children: list[Sequence], cache: CacheManager,
                   scheduler: Scheduler) -> list[Sequence]:
    """Fork ``children`` from ``parent``, whose prompt has just been prefilled: those that fit now (in the
    pool, and in the slots the request's fair share allows: :meth:`Scheduler.fork_room`) get a copy of the
    parent's cache and run (returned, in index order: they sample their first token this step from the
    parent's logits); the others wait in the scheduler's queue and will prefill the prompt themselves."""
    ready: list[Sequence] = []
    room = scheduler.fork_room(parent)
    for child in children:
        if len(ready) < room and copy_cache(cache, parent, child):
            scheduler.admit_running(child)
            ready.append(child)
        else:
            scheduler.add(child)
    return ready


def copy_cache(cache: CacheManager, parent: Sequence, child: Sequence) -> bool:
    """Give ``child`` (holding nothing) ``parent``'s cache: its full prompt pages shared, its partly filled
    last page and its recurrent state copied. False, with nothing granted, if the pool cannot hold them."""
    return cache.fork(parent, child)
