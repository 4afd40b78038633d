"""State-slot reads and writes: consecutive runs (slice path) and scattered ids agree with indexing."""

import pytest
import torch

from hybridserve.cache.slots import read_slots, write_slots


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
