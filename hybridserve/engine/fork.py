"""Parallel sampling (``n > 1``): the prompt is prefilled once, then the request forks.

A request with ``n > 1`` enters the engine as one sequence (index 0). In the step where its prompt
has been prefilled and it samples its first token, :func:`make_children` creates its ``n - 1``
children (indices 1..n-1), and the engine registers all of them before :func:`place_children` grants
any cache, so a fork is whole or not at all. Each child gets its own copy of the parent's cache, the KV of every
prompt token and the recurrent state after the prompt (:func:`copy_cache`), and samples its
first token from the parent's logits row with its own generator; from then on every child decodes
independently.

Pages are **copied, not shared**. Sharing full pages with reference counts would save the prompt's
KV ``n - 1`` times, but the recurrent state has to be copied anyway (it is rewritten in place at every
token), the pool has no reference counts, and a copy keeps "one owner per page" true everywhere
(preemption, abort and release need no special cases). The copy is one indexed memcpy inside the
pool buffer, cheap next to the prefill it replaces.

A child that cannot be forked at that moment (the pool is full, or ``max_num_seqs`` sequences are
running) is queued instead and later prefills the prompt itself, exactly like a preempted sequence:
slower, never wrong.

Seeds: with ``seed=s``, child ``i`` samples with seed ``s + i`` (the parent with ``s``), so the ``n``
completions differ from each other and the whole request is reproducible.
"""

from __future__ import annotations

import copy

import torch

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
                         parent.arrival, parent.prompt, parent.eos_token_id, index=index)
        child.prompt_logprobs = list(parent.prompt_logprobs)  # the prompt is shared: computed once
        children.append(child)
    return children


def place_children(parent: Sequence, children: list[Sequence], cache: CacheManager,
                   scheduler: Scheduler) -> list[Sequence]:
    """Fork ``children`` from ``parent``, whose prompt has just been prefilled: those that fit now get a
    copy of the parent's cache and run (returned, in index order: they sample their first token this
    step from the parent's logits); the others wait in the scheduler's queue and will prefill the
    prompt themselves."""
    ready: list[Sequence] = []
    for child in children:
        if scheduler.has_room() and copy_cache(cache, parent, child):
            scheduler.admit_running(child)
            ready.append(child)
        else:
            scheduler.add(child)
    return ready


def copy_cache(cache: CacheManager, parent: Sequence, child: Sequence) -> bool:
    """Give ``child`` (holding nothing) its own copy of ``parent``'s cache: the KV of its computed tokens
    and its recurrent state. False, with nothing granted, if the pool cannot hold the copy.

    The child's pages and slot are granted like any sequence's (the pool may compact to make room,
    which rewrites the parent's block table first), then the parent's bytes are copied into them.
    """
    if not cache.grant(child, parent.num_computed_tokens):
        return False
    child.num_computed_tokens = parent.num_computed_tokens
    pool = cache.pool
    if child.block_table:
        _copy_rows(pool.buffer, pool.layout.page_bytes, parent.block_table[:len(child.block_table)],
                   child.block_table)
    if child.state_slot is not None and parent.state_slot is not None:
        _copy_rows(pool.buffer, pool.layout.slot_bytes, [parent.state_slot], [child.state_slot])
    return True


def _copy_rows(buffer: torch.Tensor, row_bytes: int, src: list[int], dst: list[int]) -> None:
    """Copy rows ``src[i]`` to ``dst[i]`` of ``buffer`` seen as rows of ``row_bytes`` (page or slot ``i`` at
    byte ``i * row_bytes``): one indexed copy for all of them."""
    rows = buffer[:buffer.numel() // row_bytes * row_bytes].view(-1, row_bytes)  # (num_rows, row_bytes) uint8
    index = torch.tensor(dst, dtype=torch.int64, device=buffer.device)
    rows[index] = rows[torch.tensor(src, dtype=torch.int64, device=buffer.device)]
