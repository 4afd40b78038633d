"""Shared helpers of the compiled-kernel tests: ulp comparisons, state/cache views that are strided
slices of a larger pool, and the skip for machines without a C++ compiler."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.build import find_compiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# Without a compiler the kernels cannot exist (that case is tested in test_build.py); with one, a
# failed build is a test failure, not a skip.
needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler: the CPU kernels cannot be built")

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def dtype_id(dtype: torch.dtype) -> str:
    return DTYPE_IDS[dtype]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, for bit-exact comparisons (-0.0 != 0.0, NaN == same NaN)."""
    return t.contiguous().view(_INT_VIEW[t.dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.dtype, actual.shape)
    diff = bits(actual) != bits(expected)
    if diff.any():
        i = diff.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ in bits, first at {i}: "
                             f"{actual[tuple(i)].item()!r} vs {expected[tuple(i)].item()!r}")


def spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between adjacent representable numbers of ``dtype`` around each float32 value
    (one ulp), including the subnormal range."""
    fi = torch.finfo(dtype)
    mag = values.float().abs().clamp(min=fi.tiny)
    ulp = fi.eps * torch.exp2(torch.floor(torch.log2(mag)))
    return ulp.clamp(min=fi.smallest_normal * fi.eps)


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, ulps: float = 1.0,
                       atol: float | torch.Tensor = 0.0, what: str = "") -> None:
    """|actual - expected| <= ulps * ulp(dtype at max(|actual|, |expected|)) + atol, elementwise (atol: a
    number or a tensor of actual's shape)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = actual.float(), expected.float()
    assert torch.isfinite(a).all() and torch.isfinite(e).all(), what
    limit = ulps * spacing(torch.maximum(a.abs(), e.abs()), dtype) + atol
    err = (a - e).abs()
    bad = err > limit
    if bad.any():
        i = bad.nonzero()[0].tolist()
        k = tuple(i)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than {ulps} ulp(s) "
                             f"of {dtype} (+atol); first at {i}: {a[k].item()!r} vs {e[k].item()!r}, "
                             f"max err {err.max().item():.3g}")


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Max abs error relative to the reference's scale (max |expected|, at least 1)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), what
    scale = expected.float().abs().max().clamp(min=1.0)
    err = (actual.float() - expected.float()).abs().max()
    assert err <= rtol * scale, f"{what}: max err {err.item():.3g} > {rtol:g} * {scale.item():.3g}"


class Pool:
    """A typed pool buffer of num_slots rows of ``row`` elements; a view carved from it has slot
    stride ``row`` (larger than the view's slot), so writes to the wrong place show up as changes to
    bytes outside the view."""

    def __init__(self, num_slots: int, row: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.buf = torch.randn(num_slots, row, generator=g).to(dtype)  # (num_slots, row)
        self.before = self.buf.clone()

    def view(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Slot s of the view: buf[s, offset : offset + prod(shape)] reshaped to ``shape`` (contiguous)."""
        n = 1
        for d in shape:
            n *= d
        return self.buf[:, offset:offset + n].view(self.buf.shape[0], *shape)

    def expected_view(self, offset: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the pool as it was, and the same view into that copy (to write the expected result)."""
        copy = self.before.clone()
        n = 1
        for d in shape:
            n *= d
        return copy, copy[:, offset:offset + n].view(copy.shape[0], *shape)


def cu(lens) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)  # (S+1,)


def on_w4a8(x: torch.Tensor, in_features: int, group: int) -> bool:
    """Whether the 4-bit kernel runs x (..., K) on its W4A8 path here (few rows from the avx2 level on), whose
    outputs are ``linear_w4a8_ref``'s bits rather than ``linear_w4_ref``'s within rounding."""
    from hybridserve.kernels import linear_w4

    rows = x.reshape(-1, in_features).shape[0]
    return linear_w4.covers(in_features, group) and linear_w4.path(rows, x.dtype) == linear_w4.W4A8_PATH


def coded_many_rows_path(paths: tuple[str, ...], isa_level: str, act: torch.dtype) -> str:
    """The path a coded-weight linear (4-bit, Q6_K; ``paths`` its module's path names) takes for calls of 16+
    rows: the AMX tiles for bf16 at amx, the bf16 dot products at avx512_bf16 on CPUs that prefer them, else the
    float32 panels."""
    from hybridserve.kernels import gemm

    if act == torch.bfloat16 and isa_level == "amx":
        return paths[1]
    if act == torch.bfloat16 and isa_level == "avx512_bf16" and gemm.uses_bf16_dot():
        return paths[4]
    return paths[3]


def w4_operands(N: int, K: int, group: int, with_mins: bool, g: torch.Generator):
    """Random 4-bit codes (N, K) and float16-exact scales (and mins) (N, G), as the packed buffer keeps them."""
    from hybridserve.kernels import linear_w4

    G = linear_w4.num_groups(K, group)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = ((torch.rand(N, G, generator=g) + 0.5) / (8 * K ** 0.5)).half().float()
    mins = (-torch.rand(N, G, generator=g) / K ** 0.5).half().float() if with_mins else None
    return codes, scales, mins


#: the two forms 4-bit scales and mins are packed in (kernels/linear_w4.py): float16, or uint8 sub-scales times a
#: float16 super-scale per 256 in-features
W4_SCALE_FORMS = ["f16", "sub"]


def w4_form_operands(N: int, K: int, group: int, with_mins: bool, g: torch.Generator, form: str):
    """:func:`w4_operands` in scale form ``form`` (:data:`W4_SCALE_FORMS`): codes, scales, mins and the ``supers``
    to pack them with (None for float16; for "sub", float16 super-scales, and the scales and mins their products
    with random sub-scales 0..255, 0 included)."""
    from hybridserve.kernels import linear_w4

    if form == "f16":
        return (*w4_operands(N, K, group, with_mins, g), None)
    G, S = linear_w4.num_groups(K, group), linear_w4.num_supers(K, group)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = ((torch.rand(N, S, generator=g) + 0.5) / (8 * K ** 0.5 * 128)).half().float()
    scales = linear_w4.expand_supers(d, K, group) * torch.randint(0, 256, (N, G), generator=g).float()
    if not with_mins:
        return codes, scales, None, (d, None)
    d_min = (-torch.rand(N, S, generator=g) / (K ** 0.5 * 128)).half().float()
    mins = linear_w4.expand_supers(d_min, K, group) * torch.randint(0, 256, (N, G), generator=g).float()
    return codes, scales, mins, (d, d_min)


def random_experts(E: int, H: int, I: int, gated: bool, seed: int):
    """A bf16 FusedExperts block of E experts (hidden H, intermediate I; silu-gated or relu2) with N(0, 0.2)
    weights drawn after ``torch.manual_seed(seed)``."""
    from hybridserve.layers.moe import FusedExperts

    torch.manual_seed(seed)
    block = FusedExperts(E, H, I, "silu" if gated else "relu2", gated=gated)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    return block.to(torch.bfloat16)
