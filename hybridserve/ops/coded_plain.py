"""The plain (PyTorch) bodies of the recurrent ops on 8-bit state: decode, run the float math, encode back.

An 8-bit state reaches an op as a :class:`~hybridserve.cache.state_codec.CodedState` (a temporal state: codes
and bfloat16 row scales in the pool) or a :class:`~hybridserve.cache.conv_codec.CodedConvState` (a conv
state). The plain bodies were written for float views of the pool, read and written at
``group.state_indices``. :func:`float_states` gives them exactly that: the groups' slots of every
state tensor gathered into float32 tensors of their own (a float state tensor's slots in its own dtype, so its
roundings are the ones it gets in place), the groups re-pointed at rows ``0..B-1`` of those, and on leaving,
every tensor written back to the pool's slots; the coded ones encoded with each sequence's rounding key
(``SeqGroup.rounding_keys``, 0 when None) and position (``SeqGroup.seq_lens``: tokens absorbed after the step).

With no coded state among the tensors it hands back the groups and tensors themselves: the float paths run
as before, with one ``isinstance`` test per call. An op whose body raises leaves the pool's slots unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch

from hybridserve.cache.state_codec import CODED_VIEWS, StateView
from hybridserve.forward_batch import ForwardBatch, SeqGroup


def any_coded(*states: StateView | None) -> bool:
    """Whether any of the state views is 8-bit codes (a kernel body declines then, before touching state)."""
    return any(isinstance(s, CODED_VIEWS) for s in states)


def _rounding_keys(group: SeqGroup) -> torch.Tensor:
    keys = group.rounding_keys
    return torch.zeros_like(group.seq_lens) if keys is None else keys


@contextmanager
def float_states(groups: Sequence[SeqGroup | None], states: Sequence[StateView]
                 ) -> Iterator[tuple[list[SeqGroup | None], tuple[torch.Tensor, ...]]]:
    """``(groups, states)`` for a plain body: unchanged when no state is coded; else the groups re-pointed at
    rows of per-call float tensors holding their slots, written back (coded ones encoded) on a clean exit."""
    if not any_coded(*states):
        yield list(groups), tuple(cast(torch.Tensor, s) for s in states)  # (no CodedState among them)
        return
    live = [g for g in groups if g is not None and g.state_indices is not None]
    if not live:  # no sequence reads state: nothing to decode
        yield list(groups), tuple(cast(torch.Tensor, s) for s in states)  # (the body reads none of them)
        return
    idx = torch.cat([cast(torch.Tensor, g.state_indices) for g in live])  # (B,) pool slots
    local_groups: list[SeqGroup | None] = []
    start = 0
    for g in groups:
        if g is None or g.state_indices is None:
            local_groups.append(g)
            continue
        n = g.num_seqs
        local_groups.append(dataclasses.replace(g, state_indices=torch.arange(start, start + n, device=idx.device)))
        start += n
    real = idx >= 0  # (B,): a negative slot is a padded row of a captured step, read as zeros, written nowhere
    padded = not bool(real.all())
    local = tuple(s.read(idx) if isinstance(s, CODED_VIEWS) else _read_float(s, idx, real, padded) for s in states)
    yield local_groups, local
    keys = torch.cat([_rounding_keys(g) for g in live])  # (B,)
    positions = torch.cat([g.seq_lens for g in live])  # (B,) tokens absorbed after the step
    for view, values in zip(states, local):
        if isinstance(view, CODED_VIEWS):
            view.write(idx, values, keys, positions)
        elif padded:
            view.index_copy_(0, idx[real], values[real])
        else:
            view.index_copy_(0, idx, values)


def _read_float(view: torch.Tensor, idx: torch.Tensor, real: torch.Tensor, padded: bool) -> torch.Tensor:
    """view (slots, *shape) at idx (B,) -> a new (B, *shape) in view's dtype; zeros where idx is negative."""
    if not padded:
        return view.index_select(0, idx)
    rows = view.index_select(0, idx.clamp(min=0))
    return rows.masked_fill_(~real.view(-1, *([1] * (rows.dim() - 1))), 0)


@contextmanager
def float_states_of_batch(batch: ForwardBatch, states: Sequence[StateView]
                          ) -> Iterator[tuple[ForwardBatch, tuple[torch.Tensor, ...]]]:
    """:func:`float_states` over a batch's decode and prefill groups: ``(batch, states)`` for a plain body."""
    with float_states((batch.decode, batch.prefill), states) as ((decode, prefill), local):
        same = decode is batch.decode and prefill is batch.prefill
        yield (batch if same else dataclasses.replace(batch, decode=decode, prefill=prefill)), local
