"""8-bit temporal state in the specs, the slot layout and the pool: codes plus bfloat16 row scales, counted
exactly, placed in the slot, handed to the ops as a CodedState, and carried by every slot copy."""

from __future__ import annotations

import pytest
import torch

from hybridserve.cache.layout import ALIGN, compute_layout
from hybridserve.cache.pool import CachePool
from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec, StateTensorSpec
from hybridserve.cache.state_codec import CodedState
from hybridserve.layers.state_shapes import mlstm_spec

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _mamba2_like(dtype) -> list[LayerCacheSpec]:
    dtypes = CacheDtypes(kv=torch.bfloat16, conv=torch.bfloat16, temporal=dtype)
    return [LayerCacheSpec(i, "mamba2", state=(dtypes.conv_state("conv", (40, 3)),
                                               dtypes.temporal_state("ssm", (4, 6, 16))))
            for i in range(2)]


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_a_coded_spec_counts_codes_and_row_scales(dtype):
    t = StateTensorSpec("ssm", (4, 6, 16), dtype)
    assert t.coded and t.scale_shape == (4, 6)
    assert t.nbytes == 4 * 6 * 16 * 1 + 4 * 6 * 2  # bfloat16 row scales
    float_t = StateTensorSpec("ssm", (4, 6, 16), torch.bfloat16)
    assert not float_t.coded and float_t.nbytes == 4 * 6 * 16 * 2
    spec = _mamba2_like(dtype)[0]
    assert spec.state_bytes_per_sequence == 40 * 3 * 2 + t.nbytes
    tensors = spec.describe()["tensors"]
    assert [(e["name"], e["dtype"], e["shape"], e["bytes"]) for e in tensors] == [
        ("conv", "bfloat16", [40, 3], 240),
        ("ssm", {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}[dtype], [4, 6, 16], 384),
        ("ssm_scale", "bfloat16", [4, 6], 48)]
    assert sum(e["bytes"] for e in tensors) == spec.state_bytes_per_sequence


def test_names_of_code_dtypes_count_like_torch_dtypes():
    """A plan's specs hold dtype names: the same bytes and the same layout as the engine's torch dtypes."""
    for name, dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        by_name, by_dtype = compute_layout(_mamba2_like(name), 16), compute_layout(_mamba2_like(dtype), 16)
        assert by_name.slot_bytes == by_dtype.slot_bytes
        assert by_name.state_bytes_per_sequence == by_dtype.state_bytes_per_sequence
        assert [(p.name, p.offset) for p in by_name.state_placements] == [
            (p.name, p.offset) for p in by_dtype.state_placements]


def test_the_mlstm_max_state_stays_float32_beside_codes():
    """m rescales C and n in log space: kept in float32 when they are 8-bit codes, in their dtype otherwise."""
    coded = mlstm_spec(0, CacheDtypes(torch.float32, torch.float32, torch.int8), num_heads=2, qk_head_dim=8,
                       v_head_dim=8)
    assert [(t.name, t.coded) for t in coded.state] == [("C", True), ("n", True), ("m", False)]
    assert str(coded.state[2].dtype).removeprefix("torch.") == "float32"
    plain = mlstm_spec(0, CacheDtypes(torch.float32, torch.float32, torch.bfloat16), num_heads=2, qk_head_dim=8,
                       v_head_dim=8)
    assert plain.state[2].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_the_pool_hands_out_codes_and_scales_in_the_slot(dtype):
    layout = compute_layout(_mamba2_like(dtype), 16)
    names = [(p.layer, p.name) for p in layout.state_placements]
    assert names == [(0, "conv"), (0, "ssm"), (0, "ssm_scale"), (1, "conv"), (1, "ssm"), (1, "ssm_scale")]
    assert all(p.offset % ALIGN == 0 for p in layout.state_placements)
    pool = CachePool(layout, 8 * layout.slot_bytes, torch.device("cpu"))
    for layer in (0, 1):
        state = pool.layer_caches[layer].state
        assert state is not None and set(state) == {"conv", "ssm"}
        ssm = state["ssm"]
        assert isinstance(ssm, CodedState) and ssm.layer == layer
        assert ssm.codes.dtype == dtype and ssm.codes.shape == (pool.num_slots, 4, 6, 16)
        assert ssm.scale.dtype == torch.bfloat16 and ssm.scale.shape == (pool.num_slots, 4, 6)
        base = pool.buffer.data_ptr()
        for view, name in ((ssm.codes, "ssm"), (ssm.scale, "ssm_scale")):  # zero-copy views at their placement
            place = next(p for p in layout.state_placements if (p.layer, p.name) == (layer, name))
            assert view.data_ptr() - base == place.offset
            assert view.stride(0) * view.element_size() == layout.slot_bytes


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_a_slot_copy_carries_codes_and_scales_unchanged(dtype):
    """Snapshots, forks, spec-decode slots and compaction copy slots whole: codes and scales come along."""
    layout = compute_layout(_mamba2_like(dtype), 16)
    pool = CachePool(layout, 8 * layout.slot_bytes, torch.device("cpu"))
    src, dst = pool.allocate(0, 2).slots
    ssm = pool.layer_caches[1].state["ssm"]
    assert isinstance(ssm, CodedState)
    values = torch.randn(1, 4, 6, 16) * torch.logspace(-3, 2, 6)[None, None, :, None]
    at = torch.tensor([pool.slots.position(src)])
    ssm.write(at, values, torch.tensor([7]), torch.tensor([11]))
    pool.copy_slot(src, dst)
    to = torch.tensor([pool.slots.position(dst)])
    assert torch.equal(ssm.codes.view(torch.uint8)[to], ssm.codes.view(torch.uint8)[at])
    assert torch.equal(ssm.scale[to], ssm.scale[at]) and bool((ssm.scale[at] > 0).all())
    assert torch.equal(ssm.read(to), ssm.read(at))
    # within one code step of each row's grid: 1/127 of the row's max for int8, at most 1/14 for e4m3 (its
    # top binade's spacing, 32 of 448)
    row_max = values[0].abs().amax(-1, keepdim=True)
    step = row_max / (127 if dtype == torch.int8 else 14)
    assert bool(((ssm.read(at)[0] - values[0]).abs() <= step * (1 + 1e-5)).all())


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_rank_slices_round_their_elements_as_the_whole_tensor_does(dtype):
    """Tensor parallelism: a rank holds a slice of the heads; with its shard_offset, its codes and scales are
    exactly those of the same heads in the unsharded tensor (rows never span ranks; the noise is numbered
    from the slice's start)."""
    heads, rows, n = 4, 3, 16
    values = torch.randn(2, heads, rows, n)
    keys, positions = torch.tensor([3, 9]), torch.tensor([40, 7])
    idx = torch.tensor([0, 1])
    whole = CodedState(torch.zeros(2, heads, rows, n, dtype=dtype), torch.zeros(2, heads, rows, dtype=torch.bfloat16),
                       layer=5)
    whole.write(idx, values, keys, positions)
    half = heads // 2
    for rank in (0, 1):
        shard = CodedState(torch.zeros(2, half, rows, n, dtype=dtype), torch.zeros(2, half, rows, dtype=torch.bfloat16),
                           layer=5, offset=rank * half * rows * n)
        shard.write(idx, values[:, rank * half:(rank + 1) * half], keys, positions)
        mine = slice(rank * half, (rank + 1) * half)
        assert torch.equal(shard.codes.view(torch.uint8), whole.codes[:, mine].view(torch.uint8))
        assert torch.equal(shard.scale, whole.scale[:, mine])


def test_the_sharder_gives_each_rank_its_slice_offset():
    from types import SimpleNamespace

    from hybridserve.distributed.sharder import Sharder

    spec = _mamba2_like(torch.int8)[0]
    sharder = SimpleNamespace(rank=1)
    sliced = Sharder.state_slices(sharder, spec, {"conv": (20, 3), "ssm": (2, 6, 16)})  # type: ignore[arg-type]
    assert [(t.name, t.shape, t.shard_offset) for t in sliced.state] == [("conv", (20, 3), 60),
                                                                        ("ssm", (2, 6, 16), 192)]
    layout = compute_layout([sliced], 16)
    pool = CachePool(layout, 4 * layout.slot_bytes, torch.device("cpu"))
    ssm = pool.layer_caches[0].state["ssm"]
    assert isinstance(ssm, CodedState) and ssm.offset == 192


def test_coded_state_skips_padding_slots():
    """A negative slot (a padded row of a captured step) reads as zeros and is written nowhere."""
    codes = torch.randint(-127, 128, (4, 2, 8), dtype=torch.int8)
    scale = torch.rand(4, 2).to(torch.bfloat16)
    state = CodedState(codes, scale, layer=1)
    before_codes, before_scale = codes.clone(), scale.clone()
    values = torch.randn(2, 2, 8)
    state.write(torch.tensor([-1, 3]), values, torch.zeros(2, dtype=torch.int64), torch.tensor([5, 6]))
    assert torch.equal(codes[:3], before_codes[:3]) and torch.equal(scale[:3], before_scale[:3])
    read = state.read(torch.tensor([-1, 3]))
    assert torch.equal(read[0], torch.zeros(2, 8))
    assert torch.allclose(read[1], values[1], atol=float(values[1].abs().max()) / 100)
