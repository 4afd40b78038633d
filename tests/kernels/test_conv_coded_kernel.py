"""The causal conv kernel over 8-bit conv state (``hs_causal_conv1d_coded``), every ISA variant this CPU runs,
against ``cache/conv_codec.py``.

The reference decodes the pool's codes and scales (``decode_conv``), runs the float-state kernel on that
float32 state (the same token loop: itself tested against the plain-PyTorch op in ``test_recurrent_kernels.py``)
and encodes its new state (``encode_conv``). Decoding and the power-of-two scaling are exact, so outputs, codes
and scales must equal the reference's bit for bit; slots outside the call and padding rows keep their bytes.
"""

from __future__ import annotations

import pytest
import torch

from hybridserve.cache.conv_codec import CodedConvState, decode_conv, encode_conv
from hybridserve.kernels import recurrent
from tests.kernels.helpers import cu, needs_compiler

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]  # every ISA variant this CPU runs

NUM_SLOTS = 9


def _pool(channels: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and exponents of NUM_SLOTS conv states whose channels span five decades, one slot all zeros."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 2, channels)[torch.randperm(channels, generator=g)]  # (D,)
    values = torch.randn(NUM_SLOTS, channels, width, generator=g) * spread[None, :, None]
    values[3] = 0.0
    return encode_conv(values)


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels,kernel", [(256, 4), (200, 4), (130, 3), (64, 2), (300, 5), (32, 4)])
@pytest.mark.parametrize("lens", [[1, 1, 1], [5, 1, 12]])
def test_coded_conv_matches_the_codec_bit_for_bit(act_dtype, channels, kernel, lens):
    codes, scale = _pool(channels, kernel - 1, seed=channels * 10 + kernel)
    state = CodedConvState(codes.clone(), scale.clone(), layer=2)
    slot_bytes = (codes[6].clone(), scale[6].clone())
    reference = decode_conv(codes, scale).contiguous()  # (slots, D, K-1) float32
    slots = torch.tensor([6, -1, 3])  # a padding row and the zero slot among them
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(sum(lens), channels, generator=g) * 3).to(act_dtype)
    weight_t = torch.randn(kernel, channels, generator=g).contiguous()
    bias = torch.randn(channels, generator=g)

    out = recurrent.causal_conv1d(x, state, weight_t, bias, cu(lens), slots, "silu")
    expected = recurrent.causal_conv1d(x, reference, weight_t, bias, cu(lens), slots, "silu")
    assert out is not None and expected is not None
    assert torch.equal(out, expected)
    new_codes, new_scale = encode_conv(reference)
    assert torch.equal(state.codes, new_codes) and torch.equal(state.scale, new_scale)
    untouched = [s for s in range(NUM_SLOTS) if s not in (6, 3)]
    assert torch.equal(state.codes[untouched], codes[untouched]) and torch.equal(state.scale[untouched],
                                                                                 scale[untouched])
    assert not torch.equal(state.codes[6], slot_bytes[0]), "the call wrote its slot"


def test_coded_conv_on_a_channel_slice_touches_only_its_channels():
    codes, scale = _pool(192, 3, seed=1)
    state = CodedConvState(codes.clone(), scale.clone(), layer=0)
    part = recurrent.conv_state_channels(state, 48, 112)
    reference = decode_conv(codes, scale)[:, 48:112].contiguous()
    slots = torch.tensor([2, 5])
    x = torch.randn(2, 64)
    weight_t = torch.randn(4, 64).contiguous()
    out = recurrent.causal_conv1d(x, part, weight_t, None, cu([1, 1]), slots, None)
    expected = recurrent.causal_conv1d(x, reference, weight_t, None, cu([1, 1]), slots, None)
    assert out is not None and expected is not None and torch.equal(out, expected)
    new_codes, new_exponents = encode_conv(reference)
    assert torch.equal(state.codes[:, 48:112], new_codes) and torch.equal(state.scale[:, 48:112], new_exponents)
    for lo, hi in ((0, 48), (112, 192)):
        assert torch.equal(state.codes[:, lo:hi], codes[:, lo:hi]) and torch.equal(state.scale[:, lo:hi],
                                                                                   scale[:, lo:hi])


def test_coded_conv_declines_a_width_one_kernel():
    codes = torch.zeros(2, 64, 0, dtype=torch.int8)  # no window to keep
    state = CodedConvState(codes, torch.zeros(2, 64, dtype=torch.int8), layer=0)
    assert recurrent.causal_conv1d(torch.randn(1, 64), state, torch.randn(1, 64), None, cu([1]),
                                   torch.tensor([0]), None) is None
