"""The Q6_K weight linears (``csrc/gemm_w6k.h``, ``gemm_w6k_vnni.h``, ``gemm_w6k_avx2.h``) at every ISA level this
CPU runs (the ``isa_level`` fixture): few-row calls from the avx2 level on (AVX-512 VNNI at avx512_bf16 and amx,
AVX2 integer vectors at avx2 and avx512) are ``linear_w6k_a8_ref``'s outputs bit for bit (int8 activations per
super-block, integer sums); the other calls (16+ rows, the generic level; the AMX tiles for bf16 at amx) are within
the stated bound of the exact product; identity rows give each weight rounded once to bf16 on every path. And the
packing: ``unpack(pack(...))`` is the identity, K not a multiple of 256 is refused naming it.

The stated bound of the float paths: one ulp of the activation dtype of the exact value (float64 over the
dequantized weight) plus (K + 8) float32 roundings of sum |x w| (the float32 vector path: each sub-block's sum in
float32, times its exact scale d sc); the AMX path and the bf16 dot products of AMD's avx512_bf16 level round each
weight to bf16 first: 2^-8 of sum |x w| more."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import linear_w6k, report
from hybridserve.ops.linear_w4 import quantize_blocks_int8
from hybridserve.ops.linear_w6k import dequantize_w6k, linear_w6k_a8_ref
from tests.kernels.helpers import assert_bits_equal, assert_within_ulps, coded_many_rows_path, needs_compiler

ACTS = [torch.bfloat16, torch.float16, torch.float32]
IDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
A8_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
BF16_WEIGHT_PATHS = (linear_w6k.W6K_PATHS[1], linear_w6k.W6K_PATHS[4])  # the weights rounded to bf16 first


def q6k_operands(N: int, K: int, g: torch.Generator):
    """Random Q6_K codes (N, K) 0..63, int8 sub-scales (N, K / 16) over the whole range, float16 d (N, K / 256)."""
    codes = torch.randint(0, 64, (N, K), generator=g, dtype=torch.uint8)
    sub = torch.randint(-128, 128, (N, K // 16), generator=g, dtype=torch.int8)
    d = ((torch.rand(N, K // 256, generator=g) + 0.5) / (2000 * K ** 0.5)).half().float()
    return codes, sub, d


def _assert_within_bound(y, x, codes, sub, d, bias, what):
    K = x.shape[-1]
    w = dequantize_w6k(codes, sub, d).double()
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.abs().T
    slack = (K + 8) * 2.0 ** -24 * magnitude
    if linear_w6k.path(x.shape[0], x.dtype) in BF16_WEIGHT_PATHS:
        slack = slack + 2.0 ** -8 * magnitude
    assert_within_ulps(y, exact.float(), x.dtype, 1.0, slack.float(), what)


def test_pack_unpack_round_trip_and_refuses_bad_k():
    g = torch.Generator().manual_seed(0)
    codes, sub, d = q6k_operands(37, 512, g)
    packed = linear_w6k.pack(codes, sub, d)
    assert packed.numel() == linear_w6k.packed_bytes(37, 512) == 3 * 2 * linear_w6k.BLOCK_BYTES
    back = linear_w6k.unpack(packed, 37, 512)
    assert all(torch.equal(a, b) for a, b in zip(back, (codes, sub, d)))
    with pytest.raises(ValueError, match="multiple of 256.*got 320"):
        linear_w6k.pack(codes[:, :320], sub[:, :20], d[:, :1])
    with pytest.raises(ValueError, match="0..63"):
        linear_w6k.pack(codes | 64, sub, d)


def test_dequantize_is_ggufs_q6_k():
    """The format's values are gguf's: (d * sc) * (q - 32), as ``gguf.quants.dequantize`` rounds it."""
    gguf = pytest.importorskip("gguf")
    from hybridserve.models.gguf.blocks import decode_q6_k_parts
    from tests.gguf.gguf_writer import encode_q6_k

    w = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)).numpy()
    raw = encode_q6_k(w)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(5, 512))
    assert torch.equal(dequantize_w6k(*decode_q6_k_parts(raw)), expected.float())


@needs_compiler
@pytest.mark.usefixtures("isa_level")
@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
@pytest.mark.parametrize("N,K", [(16, 256), (129, 768), (33, 1024)])
def test_few_row_calls(isa_level, N, K, act):
    """1..15 rows: from the avx2 level on the int8 reference's bits; at generic, within the float bound."""
    g = torch.Generator().manual_seed(N + K)
    codes, sub, d = q6k_operands(N, K, g)
    packed = linear_w6k.pack(codes, sub, d)
    wide = torch.randn(linear_w6k.A8_MAX_ROWS, K + 24, generator=g) * 3
    wide[0, :256] = 0  # a super-block of zeros (scale 1, codes 0)
    b = torch.randn(N, generator=g).to(act)
    for M in range(1, linear_w6k.A8_MAX_ROWS + 1):
        x = wide[:M].to(act)[:, 5:K + 5]  # rows further apart than K
        on_a8 = linear_w6k.path(M, act) == linear_w6k.A8_PATH
        assert on_a8 == (isa_level in A8_LEVELS), f"{M} rows at {isa_level}: {linear_w6k.path(M, act)}"
        if not on_a8:  # generic: from WIDENED_ROWS rows, float32 panels decoded once per row block
            assert linear_w6k.path(M, act) == linear_w6k.W6K_PATHS[0 if M < linear_w6k.WIDENED_ROWS else 3]
        for bias in (b, None):
            y = linear_w6k.linear(x, packed, N, bias)
            assert y is not None and y.shape == (M, N) and y.dtype == act
            if on_a8:
                assert_bits_equal(y, linear_w6k_a8_ref(x, codes, sub, d, bias), f"int8 path, {M} rows")
            else:
                _assert_within_bound(y, x, codes, sub, d, bias, f"{M} rows at {isa_level}")


@needs_compiler
@pytest.mark.usefixtures("isa_level")
@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
@pytest.mark.parametrize("M", [16, 37, 70])
def test_many_row_calls(isa_level, M, act):
    """16+ rows: never the int8 path; within the float bound (AMX tiles for bf16 at amx, bf16 dot products at
    avx512_bf16 where the CPU prefers them)."""
    g = torch.Generator().manual_seed(M)
    N, K = 45, 768
    codes, sub, d = q6k_operands(N, K, g)
    packed = linear_w6k.pack(codes, sub, d)
    x = torch.randn(M, K, generator=g).to(act)
    b = torch.randn(N, generator=g).to(act)
    assert linear_w6k.path(M, act) != linear_w6k.A8_PATH
    assert linear_w6k.path(M, act) == coded_many_rows_path(linear_w6k.W6K_PATHS, isa_level, act)
    y = linear_w6k.linear(x, packed, N, b)
    _assert_within_bound(y, x, codes, sub, d, b, f"{M} rows at {isa_level}")


@needs_compiler
@pytest.mark.usefixtures("isa_level")
def test_identity_rows_give_each_weight_rounded_once_to_bf16(isa_level):
    """A bf16 call of the identity's K rows (a many-row path at every level) gives W.T: each weight is the format's
    value (d sc) (q - 32) rounded once to bf16, whether the path widens it to float32 or to bf16 (the AMX tiles,
    the bf16 dot products) before its one product."""
    g = torch.Generator().manual_seed(11)
    N, K = 45, 512
    codes, sub, d = q6k_operands(N, K, g)
    y = linear_w6k.linear(torch.eye(K).to(torch.bfloat16), linear_w6k.pack(codes, sub, d), N, None)
    assert linear_w6k.path(K) == coded_many_rows_path(linear_w6k.W6K_PATHS, isa_level, torch.bfloat16)
    assert_bits_equal(y, (dequantize_w6k(codes, sub, d) + 0.0).to(torch.bfloat16).T, f"weights at {isa_level}")


def test_a8_reference_is_within_the_activation_rounding():
    """|int8 path - exact| <= sum over super-blocks of half the block's activation step x sum |w| over it, plus
    float32 rounding (K + 4 of sum |x w|): the integer sums lose nothing else."""
    g = torch.Generator().manual_seed(2)
    N, K = 24, 768
    codes, sub, d = q6k_operands(N, K, g)
    x = torch.randn(4, K, generator=g)
    y = linear_w6k_a8_ref(x, codes, sub, d).double()
    w = dequantize_w6k(codes, sub, d).double()
    exact = x.double() @ w.T
    _, sx = quantize_blocks_int8(x, 256)
    step = sx.double().repeat_interleave(256, dim=1)
    bound = (step / 2) @ w.abs().T + (K + 4) * 2.0 ** -24 * (x.double().abs() @ w.abs().T)
    err = (y - exact).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    assert err.max() > 0


@pytest.mark.parametrize("level", ("generic", "avx2", "avx512", "avx512_bf16", "amx"))
def test_the_report_names_the_q6k_paths(level):
    """``hybridserve env``'s Q6_K line names the int8 path and its row limit where it runs."""
    text = report.w6k_variant(level)
    assert ("int8 activations" in text) == (level in A8_LEVELS), text
    assert ("AMX-BF16" in text) == (level == "amx"), text
