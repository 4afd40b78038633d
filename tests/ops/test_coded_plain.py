"""ops/coded_plain.py: a plain body on 8-bit state decodes the groups' slots, runs its float math on rows
0..B-1 and encodes back with each sequence's rounding key and position; float states pass through untouched."""

from __future__ import annotations

import pytest
import torch

from hybridserve.cache.state_codec import CodedState, encode_rows, uniform_noise
from hybridserve.forward_batch import ForwardBatch, SeqGroup
from hybridserve.ops.coded_plain import float_states, float_states_of_batch

SLOTS, SHAPE = 6, (2, 3, 8)


def _group(slots: list[int], seq_lens: list[int], keys: list[int] | None) -> SeqGroup:
    n = len(slots)
    i64 = dict(dtype=torch.int64)
    return SeqGroup(0, n, torch.arange(n + 1, **i64), torch.tensor(seq_lens, **i64), None, torch.tensor(slots, **i64),
                    rounding_keys=None if keys is None else torch.tensor(keys, **i64))


def _coded(dtype: torch.dtype, layer: int = 3) -> CodedState:
    g = torch.Generator().manual_seed(0)
    codes, scale = encode_rows(torch.randn(SLOTS, *SHAPE, generator=g), dtype, None)
    return CodedState(codes.clone(), scale.clone(), layer)


def _body(groups, states):
    """A stand-in for an op's float math: every group's slots of the temporal state halved plus one, of the
    conv state plus one (read and written at ``state_indices``, as the plain bodies do)."""
    rec, conv = states
    for g in groups:
        idx = g.state_indices
        rec.index_copy_(0, idx, rec.index_select(0, idx) * 0.5 + 1)
        conv.index_copy_(0, idx, conv.index_select(0, idx) + 1)
    return "out"


def test_float_states_pass_through_unchanged():
    rec, conv = torch.zeros(SLOTS, *SHAPE), torch.zeros(SLOTS, 4, 3, dtype=torch.bfloat16)
    decode = _group([1, 4], [5, 9], None)
    with float_states((decode, None), (rec, conv)) as (groups, states):
        assert groups[0] is decode and groups[1] is None and states[0] is rec and states[1] is conv
    batch = ForwardBatch(None, decode, None)
    with float_states_of_batch(batch, (rec,)) as (same, (view,)):
        assert same is batch and view is rec


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_coded_states_are_decoded_run_and_encoded_with_keys_and_positions(dtype):
    rec = _coded(dtype)
    conv = torch.randn(SLOTS, 4, 3).to(torch.bfloat16)
    before_codes, before_scale, before_conv = rec.codes.clone(), rec.scale.clone(), conv.clone()
    decode, prefill = _group([4, 1], [10, 3], [7, 0]), _group([2], [40], None)
    with float_states((decode, prefill), (rec, conv)) as (groups, states):
        assert [g.state_indices.tolist() for g in groups] == [[0, 1], [2]]  # rows of the per-call tensors
        assert states[0].dtype == torch.float32 and states[1].dtype == torch.bfloat16
        assert _body(groups, states) == "out"
    idx = torch.tensor([4, 1, 2])
    want = CodedState(before_codes, before_scale, rec.layer).read(idx) * 0.5 + 1
    noise = uniform_noise(torch.tensor([7, 0, 0]), torch.tensor([10, 3, 40]), rec.layer, SHAPE)
    codes, scale = encode_rows(want, dtype, noise)
    assert torch.equal(rec.codes.view(torch.uint8)[idx], codes.view(torch.uint8))
    assert torch.equal(rec.scale[idx], scale)
    assert torch.equal(conv[idx], before_conv[idx] + 1)
    untouched = torch.tensor([0, 3, 5])
    assert torch.equal(rec.codes.view(torch.uint8)[untouched], before_codes.view(torch.uint8)[untouched])
    assert torch.equal(rec.scale[untouched], before_scale[untouched])
    assert torch.equal(conv[untouched], before_conv[untouched])


def test_a_body_that_raises_leaves_the_slots_unchanged():
    rec = _coded(torch.int8)
    before = rec.codes.clone(), rec.scale.clone()
    with pytest.raises(RuntimeError, match="boom"):
        with float_states((_group([0, 2], [4, 4], None),), (rec,)) as (_, (local,)):
            local.mul_(3)
            raise RuntimeError("boom")
    assert torch.equal(rec.codes, before[0]) and torch.equal(rec.scale, before[1])


def test_padded_rows_read_zeros_and_write_nowhere():
    """A captured step's padded row (slot -1) reads zeros from every state and changes no slot."""
    rec = _coded(torch.int8)
    conv = torch.randn(SLOTS, 4, 3).to(torch.bfloat16)
    before_codes, before_scale, before_conv = rec.codes.clone(), rec.scale.clone(), conv.clone()
    decode = _group([2, -1], [10, 0], None)
    with float_states((decode, None), (rec, conv)) as (groups, states):
        assert torch.equal(states[0][1], torch.zeros(SHAPE)) and torch.equal(states[1][1], torch.zeros(4, 3).bfloat16())
        _body([g for g in groups if g is not None], states)
    others = torch.tensor([0, 1, 3, 4, 5])
    assert torch.equal(rec.codes[others], before_codes[others]) and torch.equal(rec.scale[others], before_scale[others])
    assert torch.equal(conv[others], before_conv[others])
    assert torch.equal(conv[2], before_conv[2] + 1)
