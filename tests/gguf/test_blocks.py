"""GGUF block decoders (models/gguf/blocks.py) against the gguf package's own dequantizers: the codes, scales
and mins they give must reproduce gguf's floats exactly."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from hybridserve.models.gguf.blocks import DECODERS, FORMATS  # noqa: E402
from hybridserve.models.gguf.coded import CodedWeight, cat_rows  # noqa: E402
from hybridserve.models.gguf.reader import coded_weight  # noqa: E402

# byte offsets of each block's fp16 fields, which random bytes could make NaN or infinite
FP16_FIELDS = {"Q8_0": (0,), "Q6_K": (208,), "Q5_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2)}


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks (rows, bytes per row) of type ``name`` with finite fp16 scales."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    per_row = cols // fmt.block_elements
    raw = rng.integers(0, 256, size=(rows * per_row, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        d = rng.uniform(-0.05, 0.05, size=rows * per_row).astype(np.float16)
        raw[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, per_row * fmt.block_bytes)


def coded(name: str, raw: np.ndarray) -> CodedWeight:
    return coded_weight(name, DECODERS[name](raw))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_decoded_values_equal_gguf_dequantize(name):
    raw = random_blocks(name, rows=6, cols=512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    w = coded(name, raw)
    assert tuple(w.shape) == (6, 512)
    assert torch.equal(w.dequantize(), torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_codes_are_in_the_engine_formats(name):
    w = coded(name, random_blocks(name, rows=3, cols=256, seed=1))
    if w.bits == 8:
        assert w.codes.dtype == torch.int8
    elif w.bits == 6:  # Q6_K: codes 0..63, int8 sub-scales per 16, float16 d per 256
        assert w.codes.dtype == torch.uint8 and int(w.codes.max()) <= 63
        assert w.scales.dtype == torch.int8 and tuple(w.scales.shape) == (3, 16)
        assert torch.equal(w.super_scales, w.super_scales.half().float()) and tuple(w.super_scales.shape) == (3, 1)
        return
    else:
        assert w.codes.dtype == torch.uint8 and int(w.codes.max()) <= 15
    assert w.scales.dtype == torch.float32 and tuple(w.scales.shape) == (3, 256 // w.group)


def test_rows_and_cat_rows_keep_values():
    w = coded("Q4_K", random_blocks("Q4_K", rows=4, cols=256, seed=2))
    order = torch.tensor([2, 0, 3, 1])
    assert torch.equal(w.rows(order).dequantize(), w.dequantize()[order])
    both = cat_rows([w.rows(slice(0, 2)), w.rows(slice(2, 4))])
    assert torch.equal(both.dequantize(), w.dequantize())


def test_cat_rows_refuses_mixed_formats():
    a = coded("Q4_K", random_blocks("Q4_K", rows=2, cols=256))
    b = coded("Q4_0", random_blocks("Q4_0", rows=2, cols=256))
    with pytest.raises(ValueError, match="one format"):
        cat_rows([a, b])


def test_w4_linear_runs_the_decoded_weight():
    """Q4_0's codes and float16 scales in the 4-bit layer give the decoded weight's products (on the kernel's W4A8
    path, few rows from the avx2 level on: the W4A8 reference's over the same codes and scales)."""
    from hybridserve.layers.linear_w4 import W4Linear
    from hybridserve.ops.linear_w4 import dequantize_w4, linear_w4a8_ref
    from tests.kernels.helpers import on_w4a8

    w = coded("Q4_0", random_blocks("Q4_0", rows=5, cols=64, seed=3))
    layer = W4Linear.from_codes(64, 5, w.codes, w.scales, w.mins, w.group, None)
    assert torch.equal(dequantize_w4(*layer.unpacked(), w.group), w.dequantize())
    x = torch.randn(3, 64)
    if on_w4a8(x, 64, w.group):
        assert torch.equal(layer(x), linear_w4a8_ref(x, *layer.unpacked(), w.group))
    else:
        assert torch.allclose(layer(x), x @ w.dequantize().T, atol=1e-5)


def test_q4_k_in_the_4_bit_layer_is_exact_and_sub_scaled():
    """Q4_K's d * sc scales and -(dmin * m) mins pack sub-scaled (the float16 d and -dmin per 256, the 6-bit sc and
    m as bytes): the layer holds the decoded weight exactly, in fewer bytes than float16 scales and mins, and its
    rows (a permutation, slices stacked again) keep their super-scales."""
    from hybridserve.kernels import linear_w4
    from hybridserve.layers.linear_w4 import W4Linear
    from hybridserve.models.gguf.load import install_coded
    from hybridserve.ops.linear_w4 import dequantize_w4

    w = coded("Q4_K", random_blocks("Q4_K", rows=6, cols=512, seed=8))
    assert w.super_scales is not None and w.super_mins is not None and w.super_scales.shape == (6, 2)
    parent = torch.nn.Sequential(torch.nn.Linear(512, 6, bias=False))
    install_coded(parent[0], "weight", parent, "0", w, torch.device("cpu"))
    layer = parent[0]
    assert isinstance(layer, W4Linear) and layer.sub_scaled and layer.has_mins
    assert torch.equal(dequantize_w4(*layer.unpacked(), w.group), w.dequantize())
    assert layer.packed_weight.numel() < linear_w4.packed_bytes(6, 512, 32, True)
    order = torch.tensor([5, 0, 3, 1, 2, 4])
    both = cat_rows([w.rows(order[:3]), w.rows(order[3:])])
    assert torch.equal(both.super_mins, w.super_mins[order]) and torch.equal(both.dequantize(), w.dequantize()[order])


def test_q6_k_rows_and_cat_rows_keep_values():
    """A Q6_K weight's rows (a permutation, slices stacked again) keep their codes, sub-scales and d together."""
    w = coded("Q6_K", random_blocks("Q6_K", rows=4, cols=512, seed=4))
    order = torch.tensor([2, 0, 3, 1])
    assert torch.equal(w.rows(order).dequantize(), w.dequantize()[order])
    both = cat_rows([w.rows(slice(0, 2)), w.rows(slice(2, 4))])
    assert torch.equal(both.dequantize(), w.dequantize())


def test_w6k_linear_runs_the_decoded_weight():
    """Q6_K's codes, sub-scales and d in the 6-bit layer are the decoded weight exactly; its products are the int8
    path's reference (few rows from the avx2 level on) or the float32 product's."""
    from hybridserve.kernels import linear_w6k
    from hybridserve.layers.linear_w6k import W6KLinear
    from hybridserve.ops.linear_w6k import dequantize_w6k, linear_w6k_a8_ref

    w = coded("Q6_K", random_blocks("Q6_K", rows=5, cols=512, seed=3))
    layer = W6KLinear.from_codes(w.codes, w.scales, w.super_scales)
    assert torch.equal(dequantize_w6k(*layer.unpacked()), w.dequantize())
    x = torch.randn(3, 512)
    if linear_w6k.path(3, x.dtype) == linear_w6k.A8_PATH:
        assert torch.equal(layer(x), linear_w6k_a8_ref(x, *layer.unpacked()))
    else:
        expected = x.double() @ w.dequantize().double().T
        assert torch.allclose(layer(x).double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())
