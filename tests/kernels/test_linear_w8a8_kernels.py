"""W8A8 linears (``csrc/gemm_w8a8.h``): int8 weights with a scale per output channel times activations
quantized to int8 per row, at every ISA level this CPU runs (the ``isa_level`` fixture: AMX-INT8 tiles at the
amx level on a CPU with AMX-INT8, AVX-512 VNNI at avx512_bf16 (and amx without AMX-INT8), integer vectors below),
against the plain-PyTorch reference (``ops/linear_w8.py: linear_w8a8_ref``).

The stated bound is bit equality: the kernel quantizes with the reference's float32 operations
(x * (127 / max|x|), ties to even), its integer sums are exact, and its epilogue rounds
float(sum) * s_w * s_x + b step by step as the reference does. So a row's result depends on nothing but
the row: not on the other rows of the call, the thread count or the level."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.kernels import isa, linear_w8
from hybridserve.layers.linear_w8 import W8Linear
from hybridserve.layers.packed_linear import pack_kernel_linear_layers
from hybridserve.ops.linear_w8 import linear_w8a8_ref, quantize_int8, quantize_rows_int8
from tests.kernels.helpers import assert_bits_equal, needs_compiler

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]
ACTS = [torch.bfloat16, torch.float16, torch.float32]
IDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def _weight(N, K, g):
    return quantize_int8(torch.randn(N, K, generator=g) / K ** 0.5)


@pytest.mark.parametrize("act", ACTS, ids=IDS.get)
@pytest.mark.parametrize("M", [1, 5, 8, 9, 16, 17, 33, 100])
@pytest.mark.parametrize("N,K", [(16, 64), (40, 130), (129, 96), (33, 7), (48, 2050), (80, 13), (1, 3)])
def test_linear_w8a8_matches_the_reference_bit_for_bit(M, N, K, act):
    """Partial 16-row groups and 8-row VNNI tiles, odd column counts (a partial panel, a partial 32-column block,
    a partial 3-panel VNNI group), K below one k-quad or not a multiple of 4 (the last quad's missing k) or 64
    (zero-padded tile steps), with and without a bias, a row of zeros."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    q, s = _weight(N, K, g)
    x = (torch.randn(M, K, generator=g) * 3).to(act)
    x[M // 2] = 0  # a row of zeros: scale 1, codes 0, the bias alone
    b = torch.randn(N, generator=g).to(act) if N != 129 else None
    y = linear_w8.linear_w8a8(x, linear_w8.pack(q, s), N, b)
    assert y is not None and y.shape == (M, N) and y.dtype == act
    assert_bits_equal(y, linear_w8a8_ref(x, q, s, b), "w8a8 kernel vs reference")


@pytest.mark.parametrize("M,N,K", [
    (300, 40, 2050),  # two row chunks of the tile path (224 rows at K = 2050), a partial last group
    (64, 100, 8192),  # long rows: int32 sums of up to 8192 products of 127 x 127
])
def test_linear_w8a8_at_the_chunked_shapes(M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    q, s = _weight(N, K, g)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    y = linear_w8.linear_w8a8(x, linear_w8.pack(q, s), N, b)
    assert_bits_equal(y, linear_w8a8_ref(x, q, s, b), "w8a8 kernel vs reference")


@pytest.mark.parametrize("K", [8192, (1 << 17) - 1])
def test_extreme_codes_sum_exactly(K):
    """Every product at +-127 x 127: sums of +-132 million (K = 8192) and of 2.11e9 (K = 2^17 - 1, just inside
    int32; the VNNI path's unsigned operand, code + 128, makes its running sums wrap past 2^31 before the row
    term is subtracted), exact."""
    N = 16
    q = torch.full((N, K), 127, dtype=torch.int8)
    q[1::2] = -127
    s = torch.ones(N, 1)
    x = torch.ones(3, K, dtype=torch.float32)
    x[1] = -2.0
    y = linear_w8.linear_w8a8(x, linear_w8.pack(q, s), N, None)
    assert_bits_equal(y, linear_w8a8_ref(x, q, s), "w8a8 kernel vs reference (exact int64 sums)")
    assert torch.equal(y[:, 1], -y[:, 0]) and torch.equal(y[0], y[2]) and bool((y[1, 0] < 0) & (y[0, 0] > 0))


def test_a_row_does_not_depend_on_the_other_rows_or_threads():
    """Each row alone, the rows together, one or two threads: the same bits (per-row scales, exact sums)."""
    g = torch.Generator().manual_seed(7)
    q, s = _weight(70, 333, g)
    x = torch.randn(40, 333, generator=g).to(torch.bfloat16)
    x[3] *= 1000  # a row of large values must not change its neighbours' scales
    packed = linear_w8.pack(q, s)
    together = linear_w8.linear_w8a8(x, packed, 70, None)
    for r in (0, 3, 17, 39):
        assert_bits_equal(linear_w8.linear_w8a8(x[r:r + 1], packed, 70, None), together[r:r + 1], f"row {r}")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_w8.linear_w8a8(x, packed, 70, None)
    finally:
        torch.set_num_threads(threads)
    assert_bits_equal(one, together, "threads")


def test_quantize_rows_int8():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 0.75, 3.0]])
    q, s = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and s.shape == (3,)
    assert torch.equal(q[0], torch.tensor([127, -64, 32, 0], dtype=torch.int8))  # 63.5 -> 64 (half to even)
    assert s[1].item() == 1.0 and not q[1].any()  # a row of zeros
    assert torch.equal(q[2], torch.tensor([-127, 64, 32, 127], dtype=torch.int8))


def test_declined_calls():
    q, s = quantize_int8(torch.randn(20, 32))
    packed = linear_w8.pack(q, s)
    x = torch.randn(2, 32)
    assert linear_w8.linear_w8a8(x.double(), packed, 20, None) is None  # activation dtype
    assert linear_w8.linear_w8a8(x, packed, 40, None) is None  # wrong size
    grouped = linear_w8.pack(*quantize_int8(torch.randn(20, 32), group=16), group=16)
    assert linear_w8.linear_w8a8(x, grouped, 20, None) is None  # scales per group


def test_the_sums_run_where_the_level_has_the_instructions():
    """AMX-INT8 tiles at amx with AMX-INT8, AVX-512 VNNI at avx512_bf16 (a feature of that level) and at amx
    without AMX-INT8, integer vectors below avx512_bf16."""
    level = isa.level_in_force()
    on_tiles = level == "amx" and "amx_int8" in isa.cpu_info().features
    expected = ("AMX-INT8 tiles" if on_tiles else "AVX-512 VNNI" if isa.at_least("avx512_bf16")
                else "integer vectors")
    assert linear_w8.w8a8_sums() == expected
    assert linear_w8.w8a8_on_tiles() == on_tiles


def test_w8a8_layers_run_the_kernel_and_decline_to_the_reference():
    """pack_kernel_linear_layers(quantization="w8a8"): W8Linears with int8 activations, equal to the kernel;
    a declined call (float64) runs the reference."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(40, 64, bias=False).to(torch.bfloat16))
    q, s = quantize_int8(lin.weight)
    assert pack_kernel_linear_layers(model, "w8a8") == 2
    assert isinstance(model[0], W8Linear) and model[0].dynamic_activations and model[2].dynamic_activations
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert_bits_equal(model[0](x), linear_w8a8_ref(x, q, s, lin.bias), "layer")
    x64 = torch.randn(2, 64, dtype=torch.float64)
    assert torch.equal(model[0](x64), linear_w8a8_ref(x64, q, s, lin.bias.double()))
    with pytest.raises(ValueError, match="one scale per output channel"):
        W8Linear(lin, linear_w8.pack(q, s), torch.float8_e4m3fn, 0, dynamic_activations=True)
