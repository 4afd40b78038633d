"""State-slot reads and writes: consecutive runs (slice path) and scattered ids agree with indexing."""

import math

import pytest
import torch

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_update_ref
from hybridserve.ops.ssd import mamba2_state_update, mamba2_state_update_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [7], [2, 5, 6], [6, 5, 4], [0, 1, 3, 4], [1, 2, 3, 9]])
def test_read_write_slots_match_indexing(dtype, ids):
    torch.manual_seed(0)
    buf = torch.zeros(12 * 2 * 3 * 4 * 2, dtype=torch.uint8)
    # a strided view: every other (2, 3) block of the buffer is a slot, the rest belongs to others
    cache = buf.view(dtype).as_strided((12, 3, 2), (12, 2, 1), 0)
    other = buf.view(dtype).as_strided((12, 3, 2), (12, 2, 1), 6)
    other.copy_(torch.randn(12, 3, 2).to(dtype))
    cache.copy_(torch.randn(12, 3, 2).to(dtype))
    before_other = other.clone()
    idx = torch.tensor(ids)
    got = read_slots(cache, idx)
    assert got.dtype == torch.float32 and torch.equal(got, cache[idx].float())
    got.add_(1.0)  # a copy: the cache is untouched
    assert torch.equal(cache[idx].float() + 1.0, got)
    values = torch.randn(len(ids), 3, 2)
    expected = cache.clone()
    expected[idx] = values.to(dtype)
    write_slots(cache, idx, values)
    assert torch.equal(cache, expected)
    assert torch.equal(other, before_other)


@pytest.mark.parametrize("ids", [[-1, 0, 1], [2, -1, 3], [-1, -1], [4, 5, -1]])
def test_negative_slots_read_zeros_and_write_nothing(ids):
    """A negative slot is a padding row of a captured step: it reads as zeros and writes nowhere (its -1 would
    otherwise index the last slot)."""
    torch.manual_seed(0)
    cache = torch.randn(6, 3, 2)
    idx = torch.tensor(ids)
    got = read_slots(cache, idx)
    for row, slot in enumerate(ids):
        assert torch.equal(got[row], torch.zeros(3, 2) if slot < 0 else cache[slot])
    before = cache.clone()
    values = torch.randn(len(ids), 3, 2)
    write_slots(cache, idx, values)
    expected = before.clone()
    for row, slot in enumerate(ids):
        if slot >= 0:
            expected[slot] = values[row]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("fast", [False, True])
def test_plain_decode_bodies_skip_padding_rows(fast):
    """The plain decode updates (fast path and reference) leave every slot alone for a padding row."""
    torch.manual_seed(0)
    conv, ssm = torch.randn(4, 6, 3), torch.randn(4, 2, 3, 5)  # (slots, D, K-1), (slots, H, P, N)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    idx = torch.tensor([2, -1])
    conv_update = causal_conv1d_update if fast else causal_conv1d_update_ref
    ssm_update = mamba2_state_update if fast else mamba2_state_update_ref
    conv_update(torch.randn(2, 6), conv, torch.randn(6, 4), None, idx, "silu")
    ssm_update(ssm, torch.randn(2, 2, 3), torch.rand(2, 2), -torch.rand(2), torch.randn(2, 1, 5),
               torch.randn(2, 1, 5), None, None, True, (0.0, math.inf), idx)
    for cache, before in ((conv, before_conv), (ssm, before_ssm)):
        changed = [s for s in range(4) if not torch.equal(cache[s], before[s])]
        assert changed == [2], changed  # the real row's slot only
