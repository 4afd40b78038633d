"""The 8-bit state codec's reference (cache/state_codec.py): bfloat16 row scales rounded up so that no code
clips, codes computed against the stored scale, and one 32-bit noise hash per 4 elements."""

from __future__ import annotations

import pytest
import torch

from hybridserve.cache import state_codec as codec


def _rows(seed: int) -> torch.Tensor:
    """(64, 128) float32 rows of magnitudes 1e-6 .. 1e6, a zero row, and rows whose max / 127 is a bfloat16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-6, 6, 64)[:, None]
    x[0] = 0.0
    x[1, 5] = 127.0 * 3.0  # max / 127 exactly 3: a bfloat16 already
    x[2, 7] = -127.0 * 2.0 ** -20
    return x


def test_scale_up_gives_the_smallest_bfloat16_not_below():
    s = torch.tensor([0.0, 1.0, 3.0, 1.0 + 2.0 ** -20, 0.1, 7.3e-12, 2.0 ** -126, 3.3e38])
    up = codec.scale_up(s)
    assert up.dtype == torch.bfloat16
    assert (up.float() >= s).all()
    below = (up.float().view(torch.int32) - 0x10000).view(torch.float32)  # the bfloat16 one step lower
    assert ((below < s) | (s == 0)).all()
    assert up[1] == 1.0 and up[2] == 3.0 and up[3] == 1.0 + 2.0 ** -7  # exact stays, inexact goes up


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8_e4m3"])
def test_scales_are_bfloat16_rounded_up_and_codes_never_clip(dtype):
    x = _rows(0)
    codes, scale = codec.encode_rows(x, dtype, None)
    assert scale.dtype == codec.SCALE_DTYPE == torch.bfloat16 and scale.shape == x.shape[:-1]
    used = scale.float()
    amax = x.abs().amax(-1)
    assert (used >= amax / codec.CODE_MAX[dtype]).all()  # rounded up: max|row| / scale <= code_max
    assert (used[1:] < (amax[1:] / codec.CODE_MAX[dtype]) * (1 + 2.0 ** -7)).all()  # by less than a bfloat16 step
    assert used[0] == 0 and (codes[0].float() == 0).all()
    v = x * torch.where(used > 0, 1.0 / used, torch.zeros_like(used))[:, None]  # what the codes round
    assert v.abs().max() <= codec.CODE_MAX[dtype]
    err = (codec.decode_rows(codes, scale) - x).abs()
    if dtype == torch.int8:  # round-to-nearest with the stored scale: half a step, nothing clipped
        assert (err <= used[:, None] * (0.5 + 1e-5)).all()
        assert torch.equal(codes, torch.round(v).to(torch.int8))
    else:  # e4m3 carries 3 mantissa bits: half an ulp of each value, nothing clipped at 448
        assert (err <= x.abs() * 2.0 ** -4 + used[:, None] * 2.0 ** -10).all()


def test_one_hash_gives_the_noise_of_four_elements():
    keys, positions, layer = torch.tensor([12345, 0, 2 ** 40 + 3]), torch.tensor([37, 2, 1000]), 5
    u = codec.uniform_noise(keys, positions, layer, (3, 10))  # (S, 3, 10)
    base = codec.row_keys(keys, positions, layer)
    flat = u.reshape(3, -1)
    for e in (0, 1, 2, 3, 4, 17, 29):
        word = codec.hash32(base + e // 4)  # (S,)
        byte = (word >> (8 * (e % 4))) & 0xFF
        assert torch.equal(flat[:, e], (byte.float() + 0.5) / 256)
    steps = flat * 256 - 0.5  # every value on the 8-bit grid, strictly inside (0, 1)
    assert torch.equal(steps, steps.round()) and (flat > 0).all() and (flat < 1).all()


@pytest.mark.parametrize("offset", [0, 4, 6, 13])
def test_a_slice_numbered_from_its_offset_gets_the_whole_tensors_noise(offset):
    """A tensor-parallel rank's slice starts anywhere (not only at a multiple of 4) and rounds its elements with
    the noise they have in the whole tensor."""
    keys, positions = torch.tensor([7, 99]), torch.tensor([3, 64])
    whole = codec.uniform_noise(keys, positions, 2, (40,))
    part = codec.uniform_noise(keys, positions, 2, (3, 5), offset=offset)
    assert torch.equal(part.reshape(2, -1), whole[:, offset:offset + 15])


def test_stochastic_rounding_keeps_the_mean():
    """Averaged over positions, the decoded row is the row: the rounding is unbiased up to the 8-bit noise grid
    (a 1/512 step at most) and the sampling spread (about step / sqrt(12 * 2048))."""
    x = _rows(1)[10:11].expand(2048, 128)  # one row, 2048 positions
    positions = torch.arange(2048)
    noise = codec.uniform_noise(torch.zeros(2048, dtype=torch.int64), positions, 0, (128,))
    codes, scale = codec.encode_rows(x, torch.int8, noise)
    step = scale.float()[0]
    mean = codec.decode_rows(codes, scale).mean(0)
    assert ((mean - x[0]).abs() <= step * 0.03).all()
    assert ((mean - x[0]).abs().mean() <= step * 0.01)


def test_no_sequences_give_no_noise():
    """A write with no real rows (every row of a captured step padded) asks for the noise of 0 sequences."""
    empty = torch.zeros(0, dtype=torch.int64)
    assert codec.uniform_noise(empty, empty, 3, (2, 8), offset=6).shape == (0, 2, 8)
