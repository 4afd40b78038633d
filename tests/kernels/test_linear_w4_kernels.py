"""The 4-bit weight linears (``csrc/gemm_w4.h``) at every ISA level this CPU runs (the ``isa_level`` fixture),
centred codes and codes with mins, groups of 32 and 64 (and one group for the row), bf16 / fp16 / float32
activations, at each shape class (one row, a few, a row tile and more; the AMX tiles' row blocks, k tails and
row chunks), against the plain-PyTorch reference ``linear_w4_ref``; and 4-bit MoE experts.

The stated bound. The vector path sums x * c over a group in float32 (c the raw code, 0..15), then adds that sum
times the group's scale and the group's sum of x times its min (without mins: -8 times the scale): its output
is within one ulp of the activation dtype of the exact value (float64 over the dequantized weight), plus
(K + 4) float32 roundings of the sum of |x| (|c| s + |m|) (the sums in any order, the products with scale
and min, the bias). The AMX path and the bf16 dot products of AMD's avx512_bf16 level round each dequantized
weight to bf16 first: 2^-8 of the sum of |x w| more (half a bf16 ulp, with room for the float32 fused multiply-add
before it); identity rows show that rounding is the only one."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import gemm, linear_w4
from hybridserve.layers.linear_w4 import INT4_FORMAT, quantize_w4_sub
from hybridserve.ops.linear_w4 import dequantize_w4, linear_w4_ref, linear_w4a8_ref
from tests.kernels.helpers import (
    W4_SCALE_FORMS,
    assert_bits_equal,
    assert_within_ulps,
    coded_many_rows_path,
    needs_compiler,
    random_experts,
    w4_form_operands,
    w4_operands,
)

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]
ACTS = [torch.bfloat16, torch.float16, torch.float32]
IDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
BF16_WEIGHT_PATHS = (linear_w4.W4_PATHS[1], linear_w4.W4_PATHS[4])  # the weights rounded to bf16 first


_operands = w4_operands


def _assert_within_bound(y, x, codes, scales, mins, group, b, what):
    """y within the stated bound of the exact value, and of the reference (which obeys the same bound); a call on
    W4A8 (few rows from the avx2 level on): linear_w4a8_ref's bits (tests/kernels/test_linear_w4a8.py)."""
    if linear_w4.path(x.shape[0], x.dtype) == linear_w4.W4A8_PATH:
        assert_bits_equal(y, linear_w4a8_ref(x, codes, scales, mins, group, b), f"{what} on W4A8")
        return
    K = x.shape[-1]
    w = dequantize_w4(codes, scales, mins, group).double()
    exact = x.double() @ w.T
    s = scales.double().repeat_interleave(group, dim=1)[:, :K]
    offset = 8 * s if mins is None else mins.double().abs().repeat_interleave(group, dim=1)[:, :K]
    terms = x.double().abs() @ (codes.double() * s + offset).T
    rounding = x.double().abs() @ w.abs().T
    on_tiles = y.dtype == torch.bfloat16 and linear_w4.path(x.shape[0]) in BF16_WEIGHT_PATHS
    if b is not None:
        exact, terms = exact + b.double(), terms + b.double().abs()
    atol = (K + 4) * 2.0 ** -24 * terms + (2.0 ** -8 * rounding if on_tiles else 0)
    assert_within_ulps(y, exact.float(), y.dtype, ulps=1, atol=atol.float(), what=what)
    ref = linear_w4_ref(x, codes, scales, mins, group, b)
    assert_within_ulps(y, ref, y.dtype, ulps=2, atol=2 * atol.float(), what=f"{what}: kernel vs reference")


def test_words_are_packed_in_blocks_of_8_panels_group_by_group():
    """The packed words, derived here from the format's description: word (k8, c) of panel p holds the codes of
    k = 8 k8 .. 8 k8 + 7 of column 16 p + c in bits 4j; a block of 8 panels (the last one of 7 here) keeps its
    words group after group, each group's panel after panel: [blocks][G][block's panels][group's steps][16]."""
    N, K, group = 360, 40, 16  # 23 panels: blocks of 8, 8 and 7; groups of 2, 2 and 1 steps
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    packed = linear_w4.pack(codes, torch.ones(N, 3), None, group)
    words, panels, gw = K // 8, -(-N // 16), group // 8
    got = packed[:panels * 16 * words * 4].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for n in (0, 15, 16, 127, 128, 130, 255, 256, 300, 359):
        p, c = divmod(n, 16)
        first = p - p % linear_w4.BLOCK_PANELS
        width = min(linear_w4.BLOCK_PANELS, panels - first)
        for k8 in range(words):
            g0 = k8 // gw * gw
            steps = min(gw, words - g0)
            want = sum(int(codes[n, 8 * k8 + j]) << (4 * j) for j in range(8))
            at = (first * words + g0 * width + (p - first) * steps + k8 - g0) * 16 + c
            assert int(got[at]) == want, f"column {n}, step {k8}: word at {at}"
    assert torch.equal(linear_w4.unpack(packed, N, K, group, False)[0], codes)


@pytest.mark.parametrize("form", W4_SCALE_FORMS)
@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
@pytest.mark.parametrize("with_mins", [False, True], ids=["centred", "mins"])
@pytest.mark.parametrize("group", [32, 64, 4096])
@pytest.mark.parametrize("M", [1, 3, 7, 33])
@pytest.mark.parametrize("N,K", [(16, 64), (40, 136), (129, 96), (24, 520)])
def test_linear_w4_matches_the_reference(M, N, K, group, with_mins, act, form):
    """Every path (by rows) in both scale forms; K = 520 spans three super-blocks of sub-scales, the last short."""
    g = torch.Generator().manual_seed(M * 1000 + N + K + group)
    codes, scales, mins, supers = w4_form_operands(N, K, group, with_mins, g, form)
    x = torch.randn(M, K, generator=g).to(act)
    b = torch.randn(N, generator=g).to(act) if N != 129 else None
    packed = linear_w4.pack(codes, scales, mins, group, supers=supers)
    y = linear_w4.linear(x, packed, N, group, with_mins, b, sub_scaled=supers is not None)
    assert y is not None and y.shape == (M, N) and y.dtype == act
    _assert_within_bound(y, x, codes, scales, mins, group, b, "4-bit linear")


@pytest.mark.parametrize("form", W4_SCALE_FORMS)
@pytest.mark.parametrize("with_mins", [False, True], ids=["centred", "mins"])
@pytest.mark.parametrize("M,N,K,group", [
    (16, 48, 64, 32),      # one 16-row group, an odd panel count
    (33, 40, 1096, 64),    # a partial row group and a k tail past the last 32-k step (1096 = 34 x 32 + 8)
    (20, 33, 520, 32),     # two row groups of different strides (the partial one padded), a 4-pair k tail
    (600, 24, 2048, 64),   # several row chunks of the tiles' schedule
    (300, 100, 1024, 32),  # several column blocks and row chunks: each block widened once per call (the next
                           # block's words while one computes), the copies read again by the later chunks
])
def test_linear_w4_at_the_amx_tile_shape_classes(M, N, K, group, with_mins, form):
    """bf16 activations at shapes that take each branch of the AMX path at the amx level (row groups, tails,
    chunks), checked at every level this CPU runs against the reference."""
    g = torch.Generator().manual_seed(M + N + K)
    codes, scales, mins, supers = w4_form_operands(N, K, group, with_mins, g, form)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    y = linear_w4.linear(x, linear_w4.pack(codes, scales, mins, group, supers=supers), N, group, with_mins, b,
                         sub_scaled=supers is not None)
    assert y is not None
    _assert_within_bound(y, x, codes, scales, mins, group, b, "4-bit linear")


@pytest.mark.parametrize("form", W4_SCALE_FORMS)
@pytest.mark.parametrize("with_mins", [False, True], ids=["centred", "mins"])
@pytest.mark.parametrize("group", [32, 64])
def test_identity_rows_give_each_weight_rounded_once_to_bf16(isa_level, group, with_mins, form):
    """A bf16 call of the identity's K rows (a many-row path at every level) gives W.T: each weight is c s + m
    rounded once to bf16, whether the path widens it to float32 or to bf16 (the AMX tiles, the bf16 dot products)
    before its one product (a zero weight's sum is +0: the expected zeros are made +0)."""
    g = torch.Generator().manual_seed(group + with_mins)
    N, K = 40, 136
    codes, scales, mins, supers = w4_form_operands(N, K, group, with_mins, g, form)
    y = linear_w4.linear(torch.eye(K).to(torch.bfloat16), linear_w4.pack(codes, scales, mins, group, supers=supers),
                         N, group, with_mins, None, sub_scaled=supers is not None)
    assert linear_w4.path(K) == coded_many_rows_path(linear_w4.W4_PATHS, isa_level, torch.bfloat16)
    expected = (dequantize_w4(codes, scales, mins, group) + 0.0).to(torch.bfloat16).T
    assert_bits_equal(y, expected, f"weights at {isa_level}")


@pytest.mark.parametrize("with_mins", [False, True], ids=["centred", "mins"])
def test_tiles_over_several_blocks_of_panels(with_mins):
    """23 panels, whose words interleave in blocks of 8, 8 and 7: every path's tiles, whether they take a whole
    block, part of one or the short last one, within the bound (W4A8: the reference's bits)."""
    N, K, group = 360, 256, 32
    g = torch.Generator().manual_seed(11 + with_mins)
    codes, scales, mins, supers = w4_form_operands(N, K, group, with_mins, g, "sub")
    packed = linear_w4.pack(codes, scales, mins, group, supers=supers)
    for M in (1, 2, 3, 4, 5, 8, 15, 16, 33):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        y = linear_w4.linear(x, packed, N, group, with_mins, None, sub_scaled=True)
        assert y is not None and y.shape == (M, N)
        _assert_within_bound(y, x, codes, scales, mins, group, None, f"{M} rows over 3 blocks")


def test_calls_the_kernel_does_not_cover_are_declined():
    g = torch.Generator().manual_seed(0)
    codes, scales, _ = _operands(8, 100, 32, False, g)  # K = 100: not a multiple of 8
    assert linear_w4.linear(torch.randn(2, 100), linear_w4.pack(codes, scales, None, 32), 8, 32, False, None) is None
    codes, scales, _ = _operands(8, 96, 36, False, g)  # a group of 36: not a multiple of 8
    assert linear_w4.linear(torch.randn(2, 96), linear_w4.pack(codes, scales, None, 36), 8, 36, False, None) is None


@pytest.mark.parametrize("M", [3, 304])
def test_bits_do_not_depend_on_threads_or_on_the_rows_beside(M):
    """One thread and two give the same bits, and each row the bits a call of its 16-row block alone gives it
    (304 rows: two row chunks on the AMX tiles at amx, and so is every 16-row call)."""
    g = torch.Generator().manual_seed(M)
    N, K = 100, 1096
    codes, scales, mins = _operands(N, K, 32, True, g)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    packed = linear_w4.pack(codes, scales, mins, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_w4.linear(x, packed, N, 32, True, None)
        torch.set_num_threads(2)
        two = linear_w4.linear(x, packed, N, 32, True, None)
        parts = torch.cat([linear_w4.linear(x[m:m + 16], packed, N, 32, True, None) for m in range(0, M, 16)])
    finally:
        torch.set_num_threads(threads)
    assert_bits_equal(two, one, "two threads against one")
    assert_bits_equal(parts, one, "16-row calls against one call")


@pytest.mark.parametrize("gated", [True, False], ids=["silu_gated", "relu2"])
@pytest.mark.parametrize("T", [7, 400], ids=["decode", "prefill"])
def test_moe_experts_in_4_bits_match_the_expert_loop(T, gated):
    """The experts kernel over 4-bit expert weights against the per-expert loop over the same 4-bit linears
    (relu2 bit for bit, silu within 2 bf16 ulps: the kernel's exp), and the loop against linear_w4_ref."""
    E, H, I, k, group = 8, 96, 40, 2, 32
    block = random_experts(E, H, I, gated, T)
    up_name = "gate_up_proj" if gated else "up_proj"
    weights = {name: getattr(block, name).detach().clone() for name in (up_name, "down_proj")}

    def pack(w: torch.Tensor) -> torch.Tensor:  # as the engine packs experts: sub-scaled
        codes, scales, supers = quantize_w4_sub(w, group)
        return linear_w4.pack(codes, scales, None, group, supers=(supers, None))

    assert block.pack(pack, INT4_FORMAT, group) == 2 * E
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weight = torch.rand(T, k, generator=g)
    got = gemm.moe_experts(x, index, weight, block.tables[up_name], block.tables["down_proj"], I, gated, block.act,
                           None, INT4_FORMAT, group)
    expected = block._forward_torch(x, index, weight)
    assert got is not None and got.shape == (T, H)
    if gated:
        assert_within_ulps(got, expected, torch.bfloat16, ulps=2, what="4-bit moe experts")
    else:
        assert_bits_equal(got, expected, "4-bit moe experts")
    e = int(index[0, 0])  # one expert's up projection against the reference over its weight's 4-bit values
    codes, scales, _ = quantize_w4_sub(weights[up_name][e], group)
    one = block._linear(x[:1], up_name, e)
    if linear_w4.path(1) == linear_w4.W4A8_PATH:
        assert_bits_equal(one, linear_w4a8_ref(x[:1], codes, scales, None, group), "one expert's W4A8 up projection")
    else:
        assert_within_ulps(one, linear_w4_ref(x[:1], codes, scales, None, group), torch.bfloat16, ulps=2, atol=1e-3,
                           what="one expert's 4-bit up projection")
