"""W4Linear (``layers/linear_w4.py``): the constructor GGUF's 4-bit blocks and ``--quantization int4`` build
through, its packing (codes exact; scales and mins rounded to float16, or sub-scaled exactly), its refusals, and its
forward against ``linear_w4_ref`` whether the kernel takes the call or declines it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.kernels import fallbacks
from hybridserve.kernels import linear_w4 as kernel
from hybridserve.layers.linear_w4 import W4Linear, quantize_w4_f16, quantize_w4_sub
from hybridserve.ops.linear_w4 import dequantize_w4, linear_w4_ref, linear_w4a8_ref
from tests.kernels.helpers import on_w4a8


def _operands(N, K, group, with_mins, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, G, generator=g) / 50 + 1e-3
    mins = -torch.rand(N, G, generator=g) / 10 if with_mins else None
    return codes, scales, mins


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("with_mins", [False, True])
@pytest.mark.parametrize("N,K", [(16, 64), (37, 96), (5, 100)])
def test_from_codes_keeps_the_codes_and_rounds_scales_and_mins_to_float16(N, K, group, with_mins):
    codes, scales, mins = _operands(N, K, group, with_mins)
    layer = W4Linear.from_codes(K, N, codes, scales, mins, group, None)
    c, s, m = layer.unpacked()
    assert torch.equal(c, codes)
    assert torch.equal(s, scales.half().float())  # nearest float16, ties to even
    assert (m is None) == (mins is None)
    if mins is not None:
        assert torch.equal(m, mins.half().float())
    assert layer.packed_weight.numel() == kernel.packed_bytes(N, K, group, with_mins)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("with_mins", [False, True])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(37, 96), (5, 100)])
def test_forward_equals_the_reference_over_the_float16_rounded_scales(N, K, group, with_mins, act):
    """Kernel or fallback (K = 100 is not a multiple of 8: the kernel declines it), the output is
    ``linear_w4_ref`` over the scales and mins as packed, within the float32 sums' reordering; on the kernel's
    W4A8 path (these 6 rows from the avx2 level on) ``linear_w4a8_ref``'s bits."""
    codes, scales, mins = _operands(N, K, group, with_mins, seed=N + K)
    bias = torch.randn(N).to(act)
    layer = W4Linear.from_codes(K, N, codes, scales, mins, group, bias)
    x = torch.randn(3, 2, K).to(act)
    y = layer(x)
    packed_mins = None if mins is None else mins.half().float()
    assert y.shape == (3, 2, N) and y.dtype == act
    if on_w4a8(x, K, group):
        assert torch.equal(y, linear_w4a8_ref(x, codes, scales.half().float(), packed_mins, group, bias))
        return
    ref = linear_w4_ref(x, codes, scales.half().float(), packed_mins, group, bias)
    w = dequantize_w4(codes, scales.half().float(), None if mins is None else mins.half().float(), group)
    mag = x.float().abs() @ w.abs().T + bias.float().abs()
    ulp = torch.finfo(act).eps * ref.float().abs()
    assert ((y.float() - ref.float()).abs() <= 2 * ulp + (K + 2) * 2 * 2.0 ** -24 * mag).all()


def test_a_declined_call_is_counted_as_a_fallback():
    codes, scales, _ = _operands(8, 100, 32, False)
    layer = W4Linear.from_codes(100, 8, codes, scales, None, 32, None)
    fallbacks.reset()
    layer(torch.randn(2, 100))
    assert any(op == "linear_w4" for op, _ in fallbacks.counts())
    fallbacks.reset()


def test_bad_operands_are_refused_naming_the_value():
    codes, scales, mins = _operands(8, 64, 32, True)
    with pytest.raises(ValueError, match="0..15, got a code of 16"):
        W4Linear.from_codes(64, 8, torch.full_like(codes, 16), scales, None, 32)
    with pytest.raises(ValueError, match=r"scales must be a float \(8, 2\)"):
        W4Linear.from_codes(64, 8, codes, scales[:, :1], None, 32)
    with pytest.raises(ValueError, match=r"float16's range"):
        W4Linear.from_codes(64, 8, codes, scales * 1e8, None, 32)
    with pytest.raises(ValueError, match=r"mins\[0, 1\] = inf"):
        bad = mins.clone()
        bad[0, 1] = float("inf")
        W4Linear.from_codes(64, 8, codes, scales, bad, 32)
    with pytest.raises(ValueError, match=r"codes must have shape \(8, 32\)"):
        W4Linear.from_codes(32, 8, codes, scales, None, 32)
    with pytest.raises(ValueError, match="group must be at least 1"):
        W4Linear.from_codes(64, 8, codes, scales, None, 0)


def test_quantize_w4_f16_picks_float16_scales_then_codes_against_them():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 200, generator=g) * 0.02
    w[3] = 0.0  # an all-zero row: scale 1, codes 8
    codes, scales = quantize_w4_f16(w, 64)
    assert scales.shape == (24, 4) and torch.equal(scales, scales.half().float())
    assert torch.equal(codes[3], torch.full((200,), 8, dtype=torch.uint8)) and (scales[3] == 1).all()
    err = (dequantize_w4(codes, scales, None, 64) - w).abs()
    # each weight within half a step of its group's grid (the largest lands on +-7 steps within float16 rounding)
    bound = scales.repeat_interleave(64, dim=1)[:, :200] * 0.5 * (1 + 2.0 ** -8)
    assert (err <= bound).all()


@pytest.mark.parametrize("with_mins", [False, True])
@pytest.mark.parametrize("N,K,group", [(16, 512, 32), (37, 520, 64), (5, 96, 4096)])
def test_sub_scaled_packing_keeps_scales_and_mins_exactly(N, K, group, with_mins):
    """Scales and mins that are float16 super-scales (one per 256 in-features) times integers 0..255 come back
    exactly, at 8 + 16 / 256 bits a group where float16 takes 16 (a group of all 96 in-features is its own
    super-block)."""
    g = torch.Generator().manual_seed(N + K)
    S, G = kernel.num_supers(K, group), kernel.num_groups(K, group)
    assert S == (-(-G // (256 // group)) if group <= 256 else G)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, S, generator=g) / 100).half().float()
    scales = kernel.expand_supers(d, K, group) * torch.randint(0, 256, (N, G), generator=g)
    d_min = mins = None
    if with_mins:
        d_min = -(torch.rand(N, S, generator=g) / 100).half().float()
        mins = kernel.expand_supers(d_min, K, group) * torch.randint(0, 256, (N, G), generator=g)
    layer = W4Linear.from_codes(K, N, codes, scales, mins, group, None, supers=(d, d_min))
    c, s, m = layer.unpacked()
    assert torch.equal(c, codes) and torch.equal(s, scales)
    assert (m is None and mins is None) or torch.equal(m, mins)
    size = kernel.packed_bytes(N, K, group, with_mins, sub_scaled=True)
    rows = -(-N // 16) * 16
    assert layer.packed_weight.numel() == size == rows * (K // 2 + (1 + with_mins) * (G + 2 * S))
    if kernel.groups_per_super(K, group) > 1:  # one group a super-block: 8 + 16 bits a group, more than float16
        assert size < kernel.packed_bytes(N, K, group, with_mins)


def test_sub_scaled_packing_refuses_scales_that_are_not_products():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8, 256), generator=g, dtype=torch.uint8)
    d = torch.full((8, 1), 0.01).half().float()
    scales = d * torch.randint(1, 256, (8, 8), generator=g)
    bad = scales.clone()
    bad[2, 5] = d[2, 0] * 3.5
    with pytest.raises(ValueError, match=r"scales\[2, 5\] = .* times an integer 0..255"):
        W4Linear.from_codes(256, 8, codes, bad, None, 32, supers=(d, None))
    with pytest.raises(ValueError, match=r"times an integer 0..255"):
        W4Linear.from_codes(256, 8, codes, d.expand(8, 8) * 256, None, 32, supers=(d, None))  # a sub-scale past 255
    with pytest.raises(ValueError, match="must hold float16 values"):
        W4Linear.from_codes(256, 8, codes, scales, None, 32, supers=(d + 1e-7, None))
    with pytest.raises(ValueError, match=r"super-scales of the mins must be a float \(8, 1\)"):
        W4Linear.from_codes(256, 8, codes, scales, -scales, 32, supers=(d, None))


@pytest.mark.parametrize("magnitude", [0.02, 1e-4])
def test_quantize_w4_sub_never_clips_and_stays_near_float16_scales(magnitude):
    """Every weight within half a step of its group's grid (the sub-scale rounded up: no weight beyond +-7 steps),
    tiny weights (float16 subnormal super-scales) included; the RMS error within 1% of float16 scales'."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 520, generator=g) * magnitude
    w[:, 256:288] *= 0.01  # a group far below its super-block's largest
    w[3] = 0.0  # an all-zero row: scale 0, codes 8
    codes, scales, supers = quantize_w4_sub(w, 32)
    assert supers.shape == (48, 3) and torch.equal(supers, supers.half().float())
    assert torch.equal(codes[3], torch.full((520,), 8, dtype=torch.uint8)) and (scales[3] == 0).all()
    u = scales / kernel.expand_supers(supers, 520, 32).clamp(min=2.0 ** -30)
    assert torch.equal(u, u.round()) and u.max() <= 255
    err = (dequantize_w4(codes, scales, None, 32) - w).abs()
    assert (err <= scales.repeat_interleave(32, dim=1)[:, :520] * 0.5 * (1 + 2.0 ** -8)).all()
    c16, s16 = quantize_w4_f16(w, 32)
    rms_sub, rms_f16 = err.pow(2).mean().sqrt(), (dequantize_w4(c16, s16, None, 32) - w).pow(2).mean().sqrt()
    assert rms_sub <= 1.01 * rms_f16, (rms_sub, rms_f16)


def test_from_weight_keeps_the_bias_and_approximates_the_weight():
    torch.manual_seed(0)
    lin = nn.Linear(128, 40)
    layer = W4Linear.from_weight(lin, 32)
    assert layer.bias is lin.bias
    codes, scales, mins = layer.unpacked()
    assert mins is None and layer.sub_scaled
    step = scales.repeat_interleave(32, dim=1)
    assert ((dequantize_w4(codes, scales, None, 32) - lin.weight.detach()).abs() <= step * 0.5 * (1 + 2.0 ** -8)).all()
    x = torch.randn(4, 128)
    with torch.no_grad():
        if on_w4a8(x, 128, 32):
            assert torch.equal(layer(x), linear_w4a8_ref(x, codes, scales, None, 32, lin.bias))
        else:
            assert torch.allclose(layer(x), linear_w4_ref(x, codes, scales, None, 32, lin.bias), rtol=1e-5, atol=1e-5)


def test_packing_and_quantizing_in_slices_of_rows_keep_every_row():
    """More rows than one slice of the packing (4096 rows) and of the quantization: every row comes back."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(4100, 24, generator=g)
    codes, scales = quantize_w4_f16(w, 8)
    assert torch.equal(codes[4099], quantize_w4_f16(w[4099:], 8)[0][0])
    c, s, _ = W4Linear.from_codes(24, 4100, codes, scales, None, 8).unpacked()
    assert torch.equal(c, codes) and torch.equal(s, scales)
