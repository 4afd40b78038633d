"""The 8-bit weight linears (``csrc/gemm_w8.h``) at every ISA level this CPU runs (the ``isa_level``
fixture: AVX-512, AVX2 and generic builds), int8 and fp8 e4m3 codes, one scale per channel or per
group, bf16 / fp16 / float32 activations, against the plain-PyTorch reference (dequantize, then matmul).

The stated bound: the kernel sums x * q in float32 in its own order and multiplies each group's sum by
its scale, so its output is within one ulp of the activation dtype of the exact value (float64 over the
dequantized weight), plus (K + 2) float32 roundings of the sum of |terms| (the sums' error in any order,
the scale's product and the bias's add). The plain-PyTorch reference obeys the same bound, so the two
are within twice it of each other."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.kernels import gemm, linear_w8
from hybridserve.layers.linear_w8 import W8Linear
from hybridserve.layers.packed_linear import pack_kernel_linear_layers
from hybridserve.ops.linear_w8 import dequantize, linear_w8_ref, quantize_int8
from tests.kernels.helpers import assert_bits_equal, assert_within_ulps, needs_compiler

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]
ACTS = [torch.bfloat16, torch.float16, torch.float32]
FORMATS = [torch.int8, torch.float8_e4m3fn]
IDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.int8: "int8",
       torch.float8_e4m3fn: "fp8"}


def _codes(N, K, fmt, group, g):
    """Random codes (N, K) of ``fmt`` and scales (N, G): int8 from a quantized Gaussian weight; fp8 from
    Gaussian values (subnormals and the largest magnitudes included) with random positive scales."""
    w = torch.randn(N, K, generator=g) / K ** 0.5
    if fmt == torch.int8:
        return quantize_int8(w, group)
    q = (torch.randn(N, K, generator=g) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    q[0, : min(K, 4)] = torch.tensor([2.0 ** -9, -(2.0 ** -8), 448.0, -448.0][: min(K, 4)]).to(q.dtype)
    G = linear_w8.num_groups(K, group)
    return q, (torch.rand(N, G, generator=g) + 0.5) / (30 * K ** 0.5)


def _assert_within_bound(y, x, q, s, group, b, factor=1):
    w = dequantize(q, s, group).double()  # exact: q * s in float64
    exact = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    if b is not None:
        exact, magnitude = exact + b.double(), magnitude + b.double().abs()
    K = x.shape[-1]
    assert_within_ulps(y, exact.float(), y.dtype, ulps=factor,
                       atol=factor * (K + 2) * 2.0 ** -24 * magnitude.float(), what="8-bit linear")


@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS.get)
@pytest.mark.parametrize("group", [0, 32])
@pytest.mark.parametrize("M", [1, 5, 7, 9, 33])
@pytest.mark.parametrize("N,K", [(16, 64), (40, 130), (129, 96), (33, 7)])
def test_linear_w8_matches_the_reference(M, N, K, group, fmt, act):
    g = torch.Generator().manual_seed(M * 1000 + N + K + group)
    q, s = _codes(N, K, fmt, group, g)
    x = torch.randn(M, K, generator=g).to(act)
    b = torch.randn(N, generator=g).to(act) if N != 129 else None
    packed = linear_w8.pack(q, s, group)
    assert packed is not None and packed.numel() == linear_w8.packed_bytes(N, K, group)
    q2, s2 = linear_w8.unpack(packed, N, K, fmt, group)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    y = linear_w8.linear(x, packed, N, fmt, group, b)
    assert y.shape == (M, N) and y.dtype == act
    _assert_within_bound(y, x, q, s, group, b)
    ref = linear_w8_ref(x, q, s, group, b)
    _assert_within_bound(ref, x, q, s, group, b)  # the reference obeys the bound too, so
    w = dequantize(q, s, group).double()
    mag = x.double().abs() @ w.abs().T + (0 if b is None else b.double().abs())
    assert_within_ulps(y, ref, act, ulps=2, atol=2 * (K + 2) * 2.0 ** -24 * mag.float(), what="kernel vs reference")


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS.get)
@pytest.mark.parametrize("M,N,K", [
    (16, 48, 64),     # codes widened per k-step (32 rows or fewer), an odd panel count
    (33, 40, 2050),   # codes widened per column block, a partial row group, a k tail
    (20, 33, 1090),   # per k-step with a partial group (two tiles of different strides), a 1-pair k tail
    (600, 24, 8192),  # several row chunks of the per-block widening (64 rows a chunk at K = 8192)
])
def test_linear_w8_at_the_amx_tile_shape_classes(M, N, K, fmt):
    """bf16 activations over 8-bit codes at shapes that take each branch of the AMX path (codes widened per
    k-step or per column block, tails, chunks), checked at every level this CPU runs, against the reference."""
    g = torch.Generator().manual_seed(M + N + K)
    q, s = _codes(N, K, fmt, 0, g)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    y = linear_w8.linear(x, linear_w8.pack(q, s, 0), N, fmt, 0, b)
    _assert_within_bound(y, x, q, s, 0, b)
    ref = linear_w8_ref(x, q, s, 0, b)
    w = dequantize(q, s, 0).double()
    mag = x.double().abs() @ w.abs().T + b.double().abs()
    assert_within_ulps(y, ref, torch.bfloat16, ulps=2, atol=2 * (K + 2) * 2.0 ** -24 * mag.float(),
                       what="kernel vs reference")


@pytest.mark.parametrize("threads", [1, 2])
def test_many_row_calls_equal_few_row_calls_bit_for_bit(threads):
    """A call of 300 rows over 4 column blocks (two row chunks at K = 2050: codes widened per block into a
    two-block ring, the next block's widened while one computes, widened again by the second chunk) gives each
    row the bits that calls of 16 rows give it (codes widened per k-step at amx; every level's rows are
    independent)."""
    g = torch.Generator().manual_seed(11)
    N, K = 100, 2050
    q, s = _codes(N, K, torch.int8, 0, g)
    x = torch.randn(300, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    packed = linear_w8.pack(q, s)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = linear_w8.linear(x, packed, N, torch.int8, 0, b)
        parts = torch.cat([linear_w8.linear(x[m:m + 16], packed, N, torch.int8, 0, b) for m in range(0, 300, 16)])
    finally:
        torch.set_num_threads(before)
    _assert_within_bound(y, x, q, s, 0, b)
    assert_bits_equal(y, parts, "300 rows vs 16-row calls")


def test_prefill_sized_batch_and_threads():
    """More rows than one L2-sized row block, and one or two threads give the same bits."""
    g = torch.Generator().manual_seed(3)
    q, s = _codes(700, 333, torch.int8, 0, g)
    x = torch.randn(300, 333, generator=g).to(torch.bfloat16)
    packed = linear_w8.pack(q, s)
    y = linear_w8.linear(x, packed, 700, torch.int8, 0, None)
    _assert_within_bound(y, x, q, s, 0, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_w8.linear(x, packed, 700, torch.int8, 0, None)
        torch.set_num_threads(2)
        two = linear_w8.linear(x, packed, 700, torch.int8, 0, None)
    finally:
        torch.set_num_threads(threads)
    assert_bits_equal(one, two, "threads")


def test_quantize_int8_is_symmetric_per_channel_and_per_group():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 0.75, 3.0]])
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (3, 1)
    assert torch.equal(q[0], torch.tensor([127, -64, 32, 0], dtype=torch.int8))  # 63.5 -> 64 (half to even)
    assert s[1].item() == 1.0 and not q[1].any()  # an all-zero row
    assert q.abs().max() == 127 and torch.allclose(dequantize(q, s), w, atol=float(s.max()) / 2)
    qg, sg = quantize_int8(w, group=2)
    assert sg.shape == (3, 2) and torch.equal(sg[2], torch.tensor([3.0, 3.0]) / 127)
    assert (dequantize(qg, sg, 2) - w).abs().max() <= sg.max() / 2


def test_declined_calls():
    q, s = quantize_int8(torch.randn(20, 32))
    packed = linear_w8.pack(q, s)
    x = torch.randn(2, 32)
    assert linear_w8.linear(x.to(torch.float64), packed, 20, torch.int8, 0, None) is None  # activation dtype
    assert linear_w8.linear(x, packed, 40, torch.int8, 0, None) is None  # wrong size
    assert linear_w8.linear(x, packed, 20, torch.int8, 0, torch.zeros(20, dtype=torch.bfloat16)) is None  # bias
    assert linear_w8.pack(torch.randn(4, 4), torch.ones(4, 1)) is None  # not 8-bit codes
    with pytest.raises(ValueError, match="scales"):
        linear_w8.pack(q, s.T.contiguous())


def test_layers_are_packed_int8_and_run_the_kernel():
    """pack_kernel_linear_layers(quantization="int8") makes every linear a W8Linear (a shared weight once),
    equal to the kernel on the quantized weight; its plain-PyTorch path (a declined call) is the reference."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(40, 64, bias=False).to(torch.bfloat16))
    tied = nn.Linear(64, 40, bias=False).to(torch.bfloat16)
    tied.weight = lin.weight  # one weight in two layers
    model.append(tied)
    q, s = quantize_int8(lin.weight)
    assert pack_kernel_linear_layers(model, "int8") == 3
    assert all(isinstance(model[i], W8Linear) for i in (0, 2, 3))
    assert model[0].packed_weight is model[3].packed_weight
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert_bits_equal(model[0](x), linear_w8.linear(x, linear_w8.pack(q, s), 40, torch.int8, 0, lin.bias), "layer")
    x64 = torch.randn(2, 64, dtype=torch.float64)
    assert torch.equal(model[0](x64), linear_w8_ref(x64, q, s, 0, lin.bias.double()))  # declined: the reference


@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
@pytest.mark.parametrize("gated", [True, False], ids=["silu_gated", "relu2"])
def test_int8_moe_experts_kernel_matches_the_expert_loop(gated, act):
    """The block's one kernel call over int8 experts against FusedExperts' per-expert loop over the same
    8-bit linears (the bound of test_gemm_kernels' 16-bit case: silu's exp may differ by an ulp)."""
    from hybridserve.layers.moe import FusedExperts

    E, H, I, k, T = 6, 48, 40, 2, 7
    torch.manual_seed(1)
    block = FusedExperts(E, H, I, "silu" if gated else "relu2", gated=gated)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    block = block.to(act)
    model = nn.Sequential(block)
    assert pack_kernel_linear_layers(model, "int8") == 2 * E and block.weight_format == torch.int8
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(act)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weight = torch.rand(T, k, generator=g)
    got = block(x, index, weight)
    expected = block._forward_torch(x, index, weight)
    if gated:
        atol = (I + 1) * 2.0 ** -24 * expected.float().abs().max() if act == torch.float32 else 0.0
        assert_within_ulps(got, expected, act, ulps=2, atol=atol, what="int8 moe experts")
    else:
        assert_bits_equal(got, expected, "int8 moe experts")
    assert gemm.moe_experts(x, index, weight, block.tables["down_proj"], block.tables["down_proj"], I, gated,
                            block.act, None, torch.float16) is None  # not an 8-bit format
