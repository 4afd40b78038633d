"""The 8-bit conv state codec (``cache/conv_codec.py``): int8 codes and a power-of-two exponent per channel."""

from __future__ import annotations

import pytest
import torch

from hybridserve.cache.conv_codec import CodedConvState, decode_conv, encode_conv, power_of_two_exponent


def _values(seed: int, batch: int = 4, channels: int = 96, width: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-4, 3, channels)  # channels five and more decades apart
    return torch.randn(batch, channels, width, generator=g) * spread[None, :, None]


def test_the_exponent_is_the_smallest_power_of_two_at_or_above():
    q = torch.tensor([0.0, 1.0, 1.5, 0.25, 0.3, 3.0e-39, 2.0**100 * 1.0001])
    e = power_of_two_exponent(q)
    assert e.tolist() == [0, 0, 1, -2, -1, -126, 101]
    for v, k in zip(q[1:].tolist(), e[1:].tolist()):
        assert 2.0**k >= v and (k == -126 or 2.0 ** (k - 1) < v)


def test_each_value_is_within_half_a_step_of_its_channel_scale():
    x = _values(0)
    codes, exponent = encode_conv(x)
    step = torch.pow(2.0, exponent.float())[..., None]  # (B, D, 1)
    assert (decode_conv(codes, exponent) - x).abs().le(step / 2).all()
    peak = codes.abs().amax(dim=-1)  # every nonzero channel uses the upper half of the code range
    assert peak.min() >= 64 and peak.max() <= 127


def test_a_channel_of_zeros_stores_zeros():
    x = _values(1)
    x[1, 5] = 0.0
    codes, exponent = encode_conv(x)
    assert codes[1, 5].eq(0).all() and exponent[1, 5] == 0 and decode_conv(codes, exponent)[1, 5].eq(0).all()


def test_encoding_a_decoded_state_gives_it_back():
    codes, exponent = encode_conv(_values(2))
    again = encode_conv(decode_conv(codes, exponent))
    assert torch.equal(again[0], codes) and torch.equal(again[1], exponent)


def test_a_shifted_window_keeps_its_codes_unless_a_larger_input_enters():
    """Shifting by one column and appending a new input: the kept values are exact while the channel's exponent
    stays (the new input is no larger than the old maximum); a larger input re-rounds them one binade coarser."""
    codes, exponent = encode_conv(_values(3))
    decoded = decode_conv(codes, exponent)
    small = torch.cat([decoded[..., 1:], decoded[..., :1] * 0.25], dim=-1)
    keep = decoded[..., 1:].abs().amax(dim=-1) >= decoded.abs().amax(dim=-1) * 0.5  # the maximum stays in the window
    shifted, exponent2 = encode_conv(small)
    same = keep & (exponent2 == exponent)
    assert same.any()
    assert torch.equal(shifted[..., :2][same], codes[..., 1:][same])


def test_the_view_reads_and_writes_slots_and_skips_padding():
    slots = 6
    codes = torch.zeros(slots, 70, 3, dtype=torch.int8)
    exponent = torch.zeros(slots, 70, dtype=torch.int8)
    view = CodedConvState(codes, exponent, layer=1)
    x = _values(4, batch=3, channels=70)
    view.write(torch.tensor([4, -1, 1]), x)
    want_codes, want_exp = encode_conv(x[[0, 2]])
    assert torch.equal(codes[[4, 1]], want_codes) and torch.equal(exponent[[4, 1]], want_exp)
    assert codes[[0, 2, 3, 5]].eq(0).all()
    got = view.read(torch.tensor([1, -1, 4]))
    assert torch.equal(got[0], decode_conv(want_codes, want_exp)[1]) and got[1].eq(0).all()
    part = view.channels(10, 30)
    assert torch.equal(part.read(torch.tensor([4])), got[2:3, 10:30])


def test_the_view_refuses_mismatched_tensors():
    with pytest.raises(ValueError, match="int8 exponents"):
        CodedConvState(torch.zeros(2, 8, 3, dtype=torch.int8), torch.zeros(2, 8, dtype=torch.bfloat16), layer=0)
    with pytest.raises(ValueError, match=r"\(slots, D\)"):
        CodedConvState(torch.zeros(2, 8, 3, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.int8), layer=0)
