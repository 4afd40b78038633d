"""Compiled CPU row-wise kernels (``hybridserve.kernels.pointwise``) against the PyTorch code they
replace: RMSNorm (plain, zero-centered, fused with the residual add before it), Mamba2's gated group
norm in both precision modes, and silu(a) * b. bfloat16 must be bit-identical; float32 and float16
within an ulp. Inputs include column slices (rows with a stride), 3-D activations and row widths that
are not multiples of a vector width; uncovered calls are declined."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import pointwise
from hybridserve.layers.norms import GatedRMSNorm, RMSNorm
from hybridserve.ops.dispatch import kernels_on, use_kernels
from tests.kernels.helpers import DTYPES, assert_bits_equal, assert_within_ulps, dtype_id, needs_compiler, spacing

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]  # every ISA variant this CPU runs

# Allowed ulps where not bit-exact (bf16 must be): float32 sums of squares and exp are evaluated in
# another order / with another polynomial than PyTorch's (measured: <= 5 ulps); float16 rounds the
# normalized value, then multiplies by the weight (measured: <= 2 ulps).
ULPS = {torch.float32: 8, torch.float16: 2}


def assert_matches_torch(actual, expected, what):
    assert actual is not None, f"{what}: the kernel declined a covered call"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if expected.dtype == torch.bfloat16:
        assert_bits_equal(actual, expected, what)
    else:
        assert_within_ulps(actual, expected, expected.dtype, ulps=ULPS[expected.dtype], what=what)


def _norm(D, dtype, zero_centered=False, eps=1e-6, seed=0):
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(D, eps=eps, zero_centered=zero_centered)
    with torch.no_grad():
        w = torch.randn(D, generator=g) * (0.1 if zero_centered else 1.0) + (0.0 if zero_centered else 1.0)
        norm.weight.copy_(w)
    return norm.to(dtype)


def _acts(shape, dtype, seed, scale=2.0, wide_extra=0):
    """Activations of ``shape`` in dtype; with wide_extra, a column slice of a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(*shape[:-1], shape[-1] + wide_extra, generator=g).mul(scale).to(dtype)
    return full[..., wide_extra // 2: wide_extra // 2 + shape[-1]] if wide_extra else full


SHAPES = [(7, 32), (5, 100), (3, 2048), (2, 3, 96)]  # (..., D): 100 is no vector width's multiple; 3-D input


@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm_matches_torch(dtype, shape, zero_centered):
    norm = _norm(shape[-1], dtype, zero_centered, seed=shape[-1])
    x = _acts(shape, dtype, seed=1)
    assert_matches_torch(pointwise.rms_norm(x, norm.weight, norm.eps, zero_centered), norm._forward_torch(x),
                         "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm_of_column_slice(dtype):
    """x given as a column slice of a wider tensor (row stride > D)."""
    norm = _norm(64, dtype, seed=2)
    x = _acts((9, 64), dtype, seed=3, wide_extra=40)
    assert x.stride(0) == 104
    assert_matches_torch(pointwise.rms_norm(x, norm.weight, norm.eps), norm._forward_torch(x), "rms_norm")


@pytest.mark.parametrize("scale", [1.0, 0.22])  # 0.22: a residual multiplier (Granite, Falcon-H1)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_residual_fused_matches_torch(dtype, zero_centered, scale):
    D = 96
    norm = _norm(D, dtype, zero_centered, seed=4)
    x = _acts((6, D), dtype, seed=5)
    residual = _acts((6, D), dtype, seed=6, wide_extra=16)  # e.g. an output slice
    x_before, res_before = x.clone(), residual.clone()
    out = pointwise.rms_norm(x, norm.weight, norm.eps, zero_centered, residual=residual, scale=scale)
    assert out is not None and isinstance(out, tuple) and len(out) == 2
    new_x, normed = out
    # the module's own PyTorch path (the kernels are off on a fresh module)
    assert not kernels_on()
    exp_x, exp_normed = norm.add_and_norm(x, residual, scale)
    # the add is rounded like PyTorch's: bit-exact in bf16 / f16. In float32 the kernel's product and
    # sum are contracted into one FMA (the product is not rounded): off by at most half an ulp of the
    # product plus one ulp of the sum.
    if dtype == torch.float32:
        product_ulp = spacing(residual * scale, dtype)
        assert_within_ulps(new_x, exp_x, dtype, ulps=1, atol=product_ulp / 2, what="x + residual * scale")
    else:
        assert_bits_equal(new_x, exp_x, "x + residual * scale")
    # the norm of the new x (the module's, in bf16 / f16 where the new x is bit-exact)
    assert_matches_torch(normed, norm._forward_torch(new_x) if dtype == torch.float32 else exp_normed, "normed")
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # inputs untouched (not in place)


def test_rms_norm_widest_row():
    norm = _norm(8192, torch.bfloat16, seed=7)
    x = _acts((2, 8192), torch.bfloat16, seed=8)
    assert_matches_torch(pointwise.rms_norm(x, norm.weight, norm.eps), norm._forward_torch(x), "rms_norm")


def test_rms_norm_two_threads_match_one():
    """Enough rows for the parallel loop (T * D >= 32768)."""
    norm = _norm(256, torch.bfloat16, seed=9)
    x = _acts((300, 256), torch.bfloat16, seed=10)
    res = _acts((300, 256), torch.bfloat16, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = pointwise.rms_norm(x, norm.weight, norm.eps, residual=res, scale=0.5)
    finally:
        torch.set_num_threads(threads)
    exp_x, exp_normed = norm.add_and_norm(x, res, 0.5)
    assert_bits_equal(two[0], exp_x, "x")
    assert_bits_equal(two[1], exp_normed, "normed")


@pytest.mark.parametrize("group_size", [16, 64, 20])  # several groups per row; one group; no vector width
@pytest.mark.parametrize("norm_in_float32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gated_rms_norm_matches_torch(dtype, norm_in_float32, group_size):
    D, T = 80 if group_size == 20 else 64, 9
    g = torch.Generator().manual_seed(12)
    norm = GatedRMSNorm(D, group_size, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=g) * 0.5 + 1.0)
    norm = norm.to(dtype)
    y = torch.randn(T, D, generator=g) * 3  # (T, D) float32 scan output
    proj = torch.randn(T, D + 2 * D + 4, generator=g).mul(2).to(dtype)
    gate = proj[:, :D]  # a column slice of the in-projection, as in Mamba2
    expected = norm(y, gate).to(dtype) if norm_in_float32 else norm(y.to(dtype), gate)
    got = pointwise.gated_rms_norm(y, gate, norm.weight, group_size, norm.eps, norm_in_float32)
    assert_matches_torch(got, expected, f"gated_rms_norm(norm_in_float32={norm_in_float32})")


@pytest.mark.parametrize("group_size", [16, 64, 20])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_norm_before_gate_matches_torch(dtype, group_size):
    """Mamba2's group norm, then the gate (Falcon-H1 with ``mamba_norm_before_gate``), in float32 throughout:
    ``(GatedRMSNorm(y, None) * silu(gate.float())).to(dtype)``."""
    D, T = 80 if group_size == 20 else 64, 9
    g = torch.Generator().manual_seed(15)
    norm = GatedRMSNorm(D, group_size, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=g) * 0.5 + 1.0)
    norm = norm.to(dtype)
    y = torch.randn(T, D, generator=g) * 3
    gate = torch.randn(T, 3 * D, generator=g).mul(2).to(dtype)[:, :D]
    expected = (norm(y, None) * F.silu(gate.float())).to(dtype)
    for norm_in_float32 in (False, True):  # the norm is in float32 either way
        got = pointwise.gated_rms_norm(y, gate, norm.weight, group_size, norm.eps, norm_in_float32,
                                       norm_before_gate=True)
        assert_matches_torch(got, expected, f"gated_rms_norm(norm_before_gate, norm_in_float32={norm_in_float32})")


@pytest.mark.parametrize("shape", [(13, 2 * 48), (2, 5, 2 * 40)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_silu_mul_of_chunks_matches_torch(dtype, shape):
    """a, b = gate_up.chunk(2, dim=-1): column slices of one tensor."""
    gate_up = _acts(shape, dtype, seed=13, scale=3.0)
    a, b = gate_up.chunk(2, dim=-1)
    assert not a.is_contiguous() and not b.is_contiguous()
    before = gate_up.clone()
    assert_matches_torch(pointwise.silu_mul(a, b), F.silu(a) * b, "silu_mul")
    assert torch.equal(gate_up, before)


def test_silu_mul_extreme_values():
    """Large |a| (exp over/underflow in silu), zeros, and float16 values near its range end."""
    vals = torch.tensor([-100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 100.0, 6e4])
    for dtype in DTYPES:
        a = vals.to(dtype).repeat(3, 1)
        b = torch.linspace(-1, 1, vals.numel()).to(dtype).repeat(3, 1)
        assert_matches_torch(pointwise.silu_mul(a, b), F.silu(a) * b, f"silu_mul {dtype}")


@pytest.mark.parametrize("D", [64, 100])  # a vector width's multiple; not one
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_silu_gate_matches_torch(dtype, D):
    """Mamba2's gate without a norm (Falcon-H1 without ``mamba_rms_norm``): ``(y * silu(gate)).to(dtype)``
    for the float32 scan output y and a column slice of the in-projection as the gate."""
    g = torch.Generator().manual_seed(14)
    y = torch.randn(9, D, generator=g) * 3  # (T, D) float32 scan output
    proj = torch.randn(9, 3 * D + 4, generator=g).mul(3).to(dtype)
    gate = proj[:, :D]
    extreme = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0])
    gate[0, :extreme.numel()] = extreme.to(dtype)  # exp over/underflow in silu
    assert_matches_torch(pointwise.silu_gate(y, gate), (y * F.silu(gate)).to(dtype), "silu_gate")
    assert pointwise.silu_gate(y.to(torch.float16 if dtype != torch.float16 else torch.bfloat16), gate) is None
    assert pointwise.silu_gate(y[:, :8], gate) is None  # shapes differ


# ----------------------------------------------------------------------------------------------
# declined calls
# ----------------------------------------------------------------------------------------------


def test_uncovered_calls_are_declined():
    w = torch.ones(16)
    x = torch.randn(4, 16)
    assert pointwise.rms_norm(x.double(), w.double(), 1e-6) is None  # dtype
    assert pointwise.rms_norm(x, w.bfloat16(), 1e-6) is None  # weight in another dtype
    assert pointwise.rms_norm(x, torch.ones(32)[::2], 1e-6) is None  # weight not contiguous
    assert pointwise.rms_norm(torch.randn(16, 4).t(), w, 1e-6) is None  # column stride != 1
    assert pointwise.rms_norm(torch.randn(2, 8193), torch.ones(8193), 1e-6) is None  # wider than a row buffer
    assert pointwise.rms_norm(x, w, 1e-6, residual=x.bfloat16()) is None  # residual dtype
    assert pointwise.rms_norm(x, w, 1e-6, residual=x[:2]) is None  # residual shape
    y, gate = torch.randn(4, 16), torch.randn(4, 16).bfloat16()
    wb = torch.ones(16, dtype=torch.bfloat16)
    assert pointwise.gated_rms_norm(y.bfloat16(), gate, wb, 8, 1e-6, False) is None  # y must be float32
    assert pointwise.gated_rms_norm(y, gate, wb, 5, 1e-6, False) is None  # group does not divide D
    assert pointwise.gated_rms_norm(y, gate, wb, 0, 1e-6, False) is None
    assert pointwise.gated_rms_norm(y, gate, w, 8, 1e-6, False) is None  # weight dtype != gate dtype
    assert pointwise.gated_rms_norm(y, gate[:, :8], wb[:8], 8, 1e-6, False) is None  # shapes differ
    assert pointwise.silu_mul(x, x.bfloat16()) is None
    assert pointwise.silu_mul(x.int(), x.int()) is None
    assert pointwise.silu_mul(x, x[:, :8]) is None
    assert pointwise.silu_mul(torch.randn(16, 4).t(), x) is None


# ---------------------------------------------------------------------------------------------
# sampler: argmax + logsumexp in one pass
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 7), (5, 1000), (32, 32000), (3, 50257)])
def test_argmax_logsumexp_matches_torch(shape):
    g = torch.Generator().manual_seed(shape[1])
    logits = torch.randn(*shape, generator=g) * 4.0
    idx, lse = pointwise.argmax_logsumexp(logits)
    assert torch.equal(idx, logits.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=2e-6, atol=2e-6)


def test_argmax_takes_the_first_of_tied_maxima():
    logits = torch.zeros(2, 300)
    logits[0, [17, 5, 200]] = 3.0
    logits[1, [299, 298]] = -1.0  # row 1: every other entry (0.0) is the max; the first one wins
    idx, _ = pointwise.argmax_logsumexp(logits)
    assert idx.tolist() == [5, 0] == logits.argmax(-1).tolist()


def test_argmax_logsumexp_of_strided_rows():
    wide = torch.randn(4, 900)
    rows = wide[:, 100:800]  # rows with a stride of 900
    idx, lse = pointwise.argmax_logsumexp(rows)
    assert torch.equal(idx, rows.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(rows, -1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_argmax_logsumexp_declines_non_finite_rows(bad):
    logits = torch.randn(3, 64)
    logits[1, 10] = bad
    if bad == float("-inf"):  # -inf is an ordinary logit (a masked token): still covered
        idx, lse = pointwise.argmax_logsumexp(logits)
        assert torch.equal(idx, logits.argmax(-1))
        torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    else:
        assert pointwise.argmax_logsumexp(logits) is None
        assert pointwise.argmax_logsumexp(logits.to(torch.bfloat16)) is None
    assert pointwise.argmax_logsumexp(logits.to(torch.int32)) is None  # not a float dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 7), (5, 1000), (32, 32000), (3, 50257)])
def test_argmax_logsumexp_of_low_precision_logits_equals_their_float32(dtype, shape):
    """Lower-precision logits give exactly what their float32 widening gives (same index, same sum)."""
    g = torch.Generator().manual_seed(shape[1])
    low = (torch.randn(*shape, generator=g) * 4.0).to(dtype)
    idx, lse = pointwise.argmax_logsumexp(low)
    idx32, lse32 = pointwise.argmax_logsumexp(low.float())
    assert torch.equal(idx, idx32) and torch.equal(idx, low.float().argmax(-1))
    assert_bits_equal(lse, lse32, "logsumexp")


def test_sampler_with_kernel_matches_torch_path():
    from hybridserve.engine.sampler import sample
    from hybridserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4000, generator=g) * 3.0
    params = [SamplingParams(temperature=0, logprobs=3 if i % 2 else None) for i in range(6)]
    plain = sample(logits, params, [None] * 6, torch.Generator().manual_seed(0))
    with use_kernels(True):
        fused = sample(logits, params, [None] * 6, torch.Generator().manual_seed(0))
    assert fused.token_ids == plain.token_ids
    assert fused.sampled_ranks == plain.sampled_ranks
    assert fused.top_ids == plain.top_ids
    torch.testing.assert_close(torch.tensor(fused.sampled_logprobs), torch.tensor(plain.sampled_logprobs))
    for a, b in zip(fused.top_logprobs, plain.top_logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_greedy_sampler_without_logprobs_reads_the_kernels_maximum(dtype):
    """Every row greedy without logprobs: the sampled logprob is the kernel's row maximum minus its
    logsumexp (float32), exactly what the gathered logit gives."""
    from hybridserve.engine.sampler import sample
    from hybridserve.sampling_params import SamplingParams

    logits = (torch.randn(5, 3000, generator=torch.Generator().manual_seed(4)) * 3.0).to(dtype)
    params = [SamplingParams(temperature=0)] * 5
    with use_kernels(True):
        fused = sample(logits, params, [None] * 5, torch.Generator())
    plain = sample(logits, params, [None] * 5, torch.Generator())
    assert fused.token_ids == plain.token_ids == logits.float().argmax(-1).tolist()
    idx, lse = pointwise.argmax_logsumexp(logits)
    expected = (logits.float().gather(1, idx[:, None])[:, 0] - lse).tolist()
    assert fused.sampled_logprobs == expected and fused.sampled_ranks == [0] * 5
    torch.testing.assert_close(torch.tensor(fused.sampled_logprobs), torch.tensor(plain.sampled_logprobs))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_sampler_takes_model_dtype_logits_as_their_float32(kernels, logprobs):
    """bf16 logits (greedy without logprobs: the fast path; otherwise widened first) sample exactly as
    their float32 widening does."""
    from hybridserve.engine.sampler import sample
    from hybridserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(5)
    low = (torch.randn(4, 3000, generator=g) * 3.0).to(torch.bfloat16)
    params = [SamplingParams(temperature=0, logprobs=logprobs) for _ in range(4)]
    with use_kernels(kernels):
        a = sample(low, params, [None] * 4, torch.Generator().manual_seed(0))
        b = sample(low.float(), params, [None] * 4, torch.Generator().manual_seed(0))
    assert a == b


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads, head_dim, rotary_dim, tokens", [(4, 64, 64, 5), (3, 64, 32, 7), (2, 128, 64, 1),
                                                                 (8, 64, 64, 600)])  # 600: two threads
def test_rotary_is_bit_identical_to_apply_rotary(dtype, heads, head_dim, rotary_dim, tokens):
    """In place on a column slice (q of a wider qkv row), every dtype bit for bit, partial rotary included."""
    from hybridserve.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(tokens, heads * head_dim + 48, generator=g) * 3).to(dtype)
    q = qkv[:, :heads * head_dim]
    angles = torch.rand(tokens, rotary_dim // 2, generator=g) * 500
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = apply_rotary(q.reshape(tokens, heads, head_dim), cos, sin).reshape(tokens, -1)
    rest = qkv[:, heads * head_dim:].clone()
    assert pointwise.rotary(q, heads, head_dim, cos, sin)
    assert_bits_equal(q, expected, "rotary")
    assert torch.equal(qkv[:, heads * head_dim:], rest), "features past the heads changed"


def test_rotary_declines_uncovered_calls():
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    c = torch.randn(2, 64, dtype=torch.bfloat16)
    assert not pointwise.rotary(x, 2, 64, c.float(), c.float())  # cos/sin dtype differs
    assert not pointwise.rotary(x, 2, 64, c[:, :63], c[:, :63])  # odd rotary dim
    assert not pointwise.rotary(x, 1, 64, c, c)  # heads x head_dim != width
    assert not pointwise.rotary(x[:, ::2], 1, 64, c, c)  # strided rows
    assert not pointwise.rotary(x.to(torch.int32), 2, 64, c, c)


@pytest.mark.parametrize("norm_rounded", [True, False], ids=["layer_norm", "final_norm"])
@pytest.mark.parametrize("stream_dtype", ["model", "float32"])  # the first layer adds to the embeddings
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_float32_stream_norm_matches_torch(dtype, stream_dtype, norm_rounded):
    """Mamba2's residual_in_fp32: x.float() + h in float32, then the norm of its rounding (a layer's)
    or of the float32 sum (the final norm), against the module's PyTorch path."""
    D = 100
    norm = _norm(D, dtype, seed=7)
    x = _acts((5, D), torch.float32 if stream_dtype == "float32" else dtype, seed=8)
    h = _acts((5, D), dtype, seed=9, wide_extra=12)
    expected_x, expected = norm.add_and_norm_float32(x, h, norm_rounded)  # kernels off: PyTorch
    got = pointwise.rms_norm_stream(x, norm.weight, norm.eps, h, norm_rounded)
    assert got is not None
    assert_bits_equal(got[0], expected_x, "x.float() + h")
    assert_matches_torch(got[1], expected, "normed")
    final = pointwise.rms_norm_stream(expected_x, norm.weight, norm.eps, None, round_input=False)
    assert_matches_torch(final, norm._forward_torch(expected_x).to(dtype), "norm of the float32 stream")


# element-wise glue: each against the PyTorch expression it replaces (bit for bit where no
# transcendental is involved; gelu, silu and sigmoid within an ulp of their float32 value)
EXACT_ELEMENTWISE = {
    "add": (lambda a, b: pointwise.add(a, b), lambda a, b: a + b),
    "add_scaled": (lambda a, b: pointwise.add(a, b, 0.37), lambda a, b: a + b * 0.37),
    "mul": (pointwise.mul, lambda a, b: a * b),
    "scale": (lambda a, b: pointwise.scale(a, 1.7), lambda a, b: a * 1.7),
    "scale_columns": (lambda a, b: pointwise.scale(a, b[0].contiguous()), lambda a, b: a * b[0]),
    "relu2": (lambda a, b: pointwise.relu2(a), lambda a, b: torch.square(F.relu(a))),
    "concat": (pointwise.concat_cols, lambda a, b: torch.cat([a, b], dim=-1)),
}
ROUGH_ELEMENTWISE = {
    "gelu_mul": (pointwise.gelu_mul, lambda a, b: F.gelu(a) * b),
    "silu": (lambda a, b: pointwise.silu(a), lambda a, b: F.silu(a)),
    "sigmoid_mul": (pointwise.sigmoid_mul, lambda a, b: torch.sigmoid(a) * b),
}


@pytest.mark.parametrize("op", list(EXACT_ELEMENTWISE) + list(ROUGH_ELEMENTWISE))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_elementwise_kernels_match_torch(dtype, op):
    a = _acts((7, 100), dtype, seed=11, wide_extra=10)  # a column slice: rows with a stride
    b = _acts((7, 100), dtype, seed=12)
    kernel, torch_fn = {**EXACT_ELEMENTWISE, **ROUGH_ELEMENTWISE}[op]
    got, expected = kernel(a, b), torch_fn(a, b)
    assert got is not None and got.dtype == expected.dtype and got.shape == expected.shape, op
    if op in EXACT_ELEMENTWISE:
        assert_bits_equal(got, expected, op)
    else:
        assert_within_ulps(got, expected, dtype, ulps=2, atol=1e-6, what=op)


def test_elementwise_kernels_decline_mismatched_inputs():
    a = torch.zeros(3, 8, dtype=torch.bfloat16)
    assert pointwise.add(a, torch.zeros(3, 8)) is None  # dtypes differ
    assert pointwise.mul(a, torch.zeros(3, 4, dtype=torch.bfloat16)) is None  # shapes differ
    assert pointwise.scale(a, torch.ones(4, dtype=torch.bfloat16)) is None  # a column factor per column
    assert pointwise.concat_cols(a, torch.zeros(2, 8, dtype=torch.bfloat16)) is None  # rows differ


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_norm_then_gate_and_row_gate_match_torch(dtype):
    from hybridserve.layers.gated_deltanet import NormThenGateRMSNorm

    norm = NormThenGateRMSNorm(24, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24, generator=torch.Generator().manual_seed(1)) + 0.5)
    norm = norm.to(dtype)
    x, z = _acts((9, 24), dtype, seed=13), _acts((9, 24), dtype, seed=14, wide_extra=8)
    got = pointwise.norm_then_gate(x, norm.weight, norm.eps, z)
    assert_matches_torch(got, norm(x, z), "norm then gate")
    gate, h = _acts((9, 1), dtype, seed=15), _acts((9, 40), dtype, seed=16)
    got = pointwise.row_sigmoid_gate(gate, h)
    assert got is not None
    assert_within_ulps(got, torch.sigmoid(gate) * h, dtype, ulps=2, atol=1e-6, what="row sigmoid gate")
