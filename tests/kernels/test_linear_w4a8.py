"""W4A8, the few-row path of the 4-bit weight linears (``csrc/gemm_w4a8.h``): from the avx2 level on (AVX-512 VNNI
at avx512_bf16 and amx, AVX2 integer vectors at avx2 and avx512), calls of 1 to ``W4A8_MAX_ROWS`` rows quantize
their activations to int8 per block of the weight's group and sum the products exactly in int32, and give
``linear_w4a8_ref``'s outputs bit for bit (the kernel's float32 steps are the reference's, in its order, each
rounded once); at the generic level the calls keep the float32 vector path.
And the reference itself: its blocks are ``quantize_rows_int8``'s rows, and it stays within the activation
rounding's bound of the exact product."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import isa, linear_w4, report
from hybridserve.ops.linear_w4 import dequantize_w4, linear_w4a8_ref, quantize_blocks_int8
from hybridserve.ops.linear_w8 import quantize_rows_int8
from tests.kernels.helpers import (
    W4_SCALE_FORMS,
    assert_bits_equal,
    coded_many_rows_path,
    needs_compiler,
    w4_form_operands,
    w4_operands,
)

ACTS = [torch.bfloat16, torch.float16, torch.float32]
IDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
W4A8_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")


_operands = w4_operands


@needs_compiler
@pytest.mark.usefixtures("isa_level")
@pytest.mark.parametrize("form", W4_SCALE_FORMS)
@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
@pytest.mark.parametrize("with_mins", [False, True], ids=["centred", "mins"])
@pytest.mark.parametrize("N,K,group", [
    (16, 64, 32),      # one panel, two whole groups
    (40, 136, 64),     # K not a multiple of the group (64 + 64 + 8), a partial panel
    (129, 1096, 32),   # 35 groups, the last of 8; 9 panels, the last of one column
    (33, 96, 4096),    # one group for the whole row
])
def test_few_row_calls_are_the_w4a8_reference_bit_for_bit(isa_level, N, K, group, with_mins, act, form):
    """Both scale forms: a sub-scaled group's scale (and min) is its float16 super-scale times its uint8 sub-scale,
    exact in float32, so the reference over the unpacked values is the kernel's arithmetic step for step."""
    g = torch.Generator().manual_seed(N + K + group + 7 * with_mins)
    codes, scales, mins, supers = w4_form_operands(N, K, group, with_mins, g, form)
    packed = linear_w4.pack(codes, scales, mins, group, supers=supers)
    wide = torch.randn(linear_w4.W4A8_MAX_ROWS, K + 24, generator=g) * 3
    wide[0, :K // 2] = 0  # a block of zeros (scale 1, codes 0)
    b = torch.randn(N, generator=g).to(act)
    for M in range(1, linear_w4.W4A8_MAX_ROWS + 1):
        x = wide[:M].to(act)[:, 5:K + 5]  # rows further apart than K
        on_w4a8 = linear_w4.path(M, act) == linear_w4.W4A8_PATH
        assert on_w4a8 == (isa_level in W4A8_LEVELS), f"{M} rows at {isa_level}: {linear_w4.path(M, act)}"
        if not on_w4a8:
            continue  # the float32 vector path: tests/kernels/test_linear_w4_kernels.py
        for bias in (b, None):
            y = linear_w4.linear(x, packed, N, group, with_mins, bias, sub_scaled=supers is not None)
            assert y is not None and y.shape == (M, N) and y.dtype == act
            assert_bits_equal(y, linear_w4a8_ref(x, codes, scales, mins, group, bias),
                              f"W4A8, {M} rows, bias {bias is not None}")


@needs_compiler
@pytest.mark.usefixtures("isa_level")
def test_more_rows_than_the_w4a8_tiles_leave_it(isa_level):
    """From W4A8_MAX_ROWS + 1 rows a call takes the other paths: AMX tiles for bf16 at amx, bf16 dot products at
    avx512_bf16 where the CPU prefers them, else float32 panels decoded once per row block (as every call of
    WIDENED_ROWS+ rows does at the generic level)."""
    rows = linear_w4.W4A8_MAX_ROWS + 1
    assert rows == linear_w4.DOT_ROWS == linear_w4.AMX_ROWS
    panels, vectors = linear_w4.W4_PATHS[3], linear_w4.W4_PATHS[0]
    for act in ACTS:
        assert linear_w4.path(rows, act) == coded_many_rows_path(linear_w4.W4_PATHS, isa_level, act)
        assert (linear_w4.path(1, act) == linear_w4.W4A8_PATH) == (isa_level in W4A8_LEVELS)
        if isa_level not in W4A8_LEVELS:
            assert linear_w4.path(linear_w4.WIDENED_ROWS - 1, act) == vectors
            assert linear_w4.path(linear_w4.WIDENED_ROWS, act) == panels
    assert isa.level_in_force() == isa_level


def test_w4a8_reference_blocks_are_the_w8a8_rows():
    """Each block of quantize_blocks_int8 is quantize_rows_int8 of that block alone, the short last one too."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 72, generator=g)
    x[1, 32:64] = 0
    codes, scales = quantize_blocks_int8(x, 32)
    assert codes.shape == (3, 72) and scales.shape == (3, 3)
    for k0 in (0, 32, 64):
        q, s = quantize_rows_int8(x[:, k0:k0 + 32])
        assert torch.equal(codes[:, k0:k0 + 32], q) and torch.equal(scales[:, k0 // 32], s)
    assert torch.equal(scales[1, 1], torch.tensor(1.0)) and not codes[1, 32:64].any()


@pytest.mark.parametrize("with_mins", [False, True], ids=["centred", "mins"])
def test_w4a8_reference_is_within_the_activation_rounding_of_the_exact_product(with_mins):
    """|W4A8 - exact| <= sum over blocks of (half the block's activation step) x sum |w| over the block, plus
    float32 rounding of the group sums (K + 4 roundings of sum |x w|, generous): the integer sums lose nothing
    else."""
    g = torch.Generator().manual_seed(2)
    N, K, group = 24, 200, 32
    codes, scales, mins = _operands(N, K, group, with_mins, g)
    x = torch.randn(4, K, generator=g)
    y = linear_w4a8_ref(x, codes, scales, mins, group).double()
    w = dequantize_w4(codes, scales, mins, group).double()
    exact = x.double() @ w.T
    _, sx = quantize_blocks_int8(x, group)
    step = sx.double().repeat_interleave(group, dim=1)[:, :K]  # (M, K): each k's block step
    bound = (step / 2) @ w.abs().T + (K + 4) * 2.0 ** -24 * (x.double().abs() @ w.abs().T)
    err = (y - exact).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    assert err.max() > 0  # the activation rounding is there


@pytest.mark.parametrize("level", isa.LEVELS)
def test_the_report_names_w4a8_at_the_levels_it_runs(level):
    """``hybridserve env``'s 4-bit line (kernels/report.py) names W4A8 and its row limit where it runs."""
    text = report.w4_variant(level)
    assert ("W4A8" in text) == (level in W4A8_LEVELS), text
    assert (f"up to {linear_w4.W4A8_MAX_ROWS} rows" in text) == (level in W4A8_LEVELS), text


@needs_compiler
@pytest.mark.usefixtures("isa_level")
@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
def test_activation_ties_round_half_to_even(isa_level, act):
    """Blocks whose largest |x| is 127 quantize with 127 / max|x| = 1, so x = k + 0.5 lands on a tie: the
    reference's codes round half to even, and the kernel's outputs (which see only the codes) are its bits."""
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 127.0])
    x = halves.repeat(1, 8)  # (1, 64): two blocks of 32, each with max |x| = 127
    codes, scales = quantize_blocks_int8(x, 32)
    assert codes[0, :8].tolist() == [0, 2, 2, 0, -2, 126, -126, 127] and torch.equal(scales, torch.ones(1, 2))
    g = torch.Generator().manual_seed(5)
    w_codes, w_scales, _ = _operands(24, 64, 32, False, g)
    packed = linear_w4.pack(w_codes, w_scales, None, 32)
    y = linear_w4.linear(x.to(act), packed, 24, 32, False, None)
    if linear_w4.path(1, act) == linear_w4.W4A8_PATH:
        assert_bits_equal(y, linear_w4a8_ref(x.to(act), w_codes, w_scales, None, 32), "W4A8 on ties")
    else:
        assert isa_level not in W4A8_LEVELS
