"""The linear kernels (``csrc/gemm.cpp``) against an exact (float64) reference, for bf16, fp16 and
float32 and at every ISA level this CPU runs (the ``isa_level`` fixture: AVX-512 BF16 dot products,
the AVX-512 and AVX2 float32 paths, the generic build): every row-count tile and its tails, partial
16-column panels, odd in-features, bias, strided and batched inputs, thread counts; the calls they
decline; and the layers that wrap them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridserve.kernels import gemm, isa
from hybridserve.layers.packed_linear import KernelLinear, pack_kernel_linear_layers
from tests.kernels.helpers import assert_bits_equal, assert_within_ulps, needs_compiler

# A failed build fails here (needs_compiler skips only machines without a compiler).
pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
IDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def test_kernel_is_available():
    assert gemm.available(), "the gemm library did not build or load (see the warning logged above)"
    # AVX-512 BF16 dot products where the level in force has them, except on Intel CPUs (their dot products
    # run at half the FMA rate: the float32 vector path is faster there); AMX tiles exactly at the amx level
    assert gemm.uses_bf16_dot() == (isa.at_least("avx512_bf16") and isa.cpu_info().vendor != "GenuineIntel")
    assert (gemm.amx_rows() > 0) == isa.at_least("amx")


def _case(M, N, K, seed, bias=True, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)  # (M, K)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)  # (N, K)
    b = torch.randn(N, generator=g).to(dtype) if bias else None  # (N,)
    return x, w, b


def _assert_matches_exact(y, x, w, b):
    """y is the float32 sum of x @ w.T + b rounded once to its dtype: within one ulp of the exact value,
    plus the float32 rounding a sum of K terms may carry in any order (K * 2^-24 * sum |terms|)."""
    exact = x.double() @ w.double().T  # (M, N)
    magnitude = x.double().abs() @ w.double().abs().T
    if b is not None:
        exact = exact + b.double()
        magnitude = magnitude + b.double().abs()
    K = x.shape[-1]
    assert y.dtype == x.dtype
    assert_within_ulps(y, exact.float(), y.dtype, ulps=1, atol=(K + 1) * 2.0 ** -24 * magnitude.float(),
                       what="linear output")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 13, 32, 37])
@pytest.mark.parametrize("N,K", [(16, 64), (40, 130), (129, 96), (200, 768), (33, 7)])
def test_linear_matches_exact(M, N, K, dtype):
    x, w, b = _case(M, N, K, seed=M * 1000 + N + K, dtype=dtype)
    packed = gemm.pack(w)
    assert packed is not None and packed.numel() == -(-N // 16) * 16 * (K + K % 2)
    y = gemm.linear(x, packed, N, b)
    assert y.shape == (M, N) and y.dtype == dtype
    _assert_matches_exact(y, x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_linear_of_a_prefill_sized_batch(dtype):
    """More rows than one L2-sized row block (the row blocks of the float32 path), odd K."""
    x, w, b = _case(300, 70, 333, seed=9, dtype=dtype)
    _assert_matches_exact(gemm.linear(x, gemm.pack(w), 70, b), x, w, b)


@pytest.mark.parametrize("M,N,K", [
    (16, 48, 64),     # one whole 16-row tile group, an odd panel count (3)
    (20, 64, 2050),   # a whole group then a partial one (two tiles of different strides), a k tail (1 pair)
    (48, 33, 1088),   # three groups, a 1-column last panel, a 2-pair k tail
    (300, 40, 4096),  # several row chunks (the amx path's L2-sized chunks: 64 rows at K = 4096), partial last group
])
def test_linear_at_the_amx_tile_shape_classes(M, N, K):
    """bf16 shapes that take each branch of the AMX tile path (kernels/csrc/gemm_amx.h: 16-row tile groups,
    padded partial groups, 32-column blocks, k-steps of 32 with a dot-product tail, row chunks), checked at
    every level this CPU runs, against the exact sum."""
    x, w, b = _case(M, N, K, seed=M + N + K)
    _assert_matches_exact(gemm.linear(x, gemm.pack(w), N, b), x, w, b)
    strided = torch.zeros(M, K + 48, dtype=torch.bfloat16)
    strided[:, 16:16 + K] = x  # rows with their own stride: the tiles load x in place
    _assert_matches_exact(gemm.linear(strided[:, 16:16 + K], gemm.pack(w), N, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("M", [1, 6, 32])
def test_linear_without_bias_and_narrow_outputs(M, dtype):
    for N in (1, 15, 17, 33):
        x, w, _ = _case(M, N, 64, seed=N, bias=False, dtype=dtype)
        _assert_matches_exact(gemm.linear(x, gemm.pack(w), N, None), x, w, None)


def test_special_values_round_as_torch():
    """Infinities and NaN pass through the float32 sums and the rounding: a NaN input gives NaN outputs,
    an overflowing sum gives inf, as torch's float32 matmul rounded to the dtype does."""
    for dtype in DTYPES:
        x, w, _ = _case(3, 20, 64, seed=11, dtype=dtype)
        x[0, 5] = float("nan")
        x[1, :] = torch.finfo(dtype).max
        w[:, :] = w.abs() + 1  # every product of row 1 is huge and positive
        y = gemm.linear(x, gemm.pack(w), 20, None)
        expected = (x.float() @ w.float().T).to(dtype)
        assert torch.isnan(y[0]).all() and torch.isnan(expected[0]).all()
        assert torch.equal(y[1], expected[1]) and torch.isinf(y[1]).all()


def test_linear_takes_strided_rows_and_batched_input():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(11, 300, generator=g).to(torch.bfloat16)
    x = wide[:, 20:148]  # (11, 128) rows with stride 300
    _, w, b = _case(1, 70, 128, seed=2)
    y = gemm.linear(x, gemm.pack(w), 70, b)
    _assert_matches_exact(y, x, w, b)
    assert torch.equal(wide, wide.clone())  # read only
    x3 = torch.randn(2, 5, 128, generator=g).to(torch.bfloat16)  # (batch, tokens, K)
    y3 = gemm.linear(x3, gemm.pack(w), 70, b)
    assert y3.shape == (2, 5, 70)
    assert_bits_equal(y3.reshape(10, 70), gemm.linear(x3.reshape(10, 128), gemm.pack(w), 70, b), "batched input")
    empty = gemm.linear(torch.empty(0, 128, dtype=torch.bfloat16), gemm.pack(w), 70, b)
    assert empty.shape == (0, 70)


def test_weight_strides_are_respected_when_packing():
    big = torch.randn(50, 200).to(torch.bfloat16)
    w = big[:, :64]  # (50, 64) with row stride 200
    x, _, b = _case(3, 50, 64, seed=3)
    assert_bits_equal(gemm.linear(x, gemm.pack(w), 50, b), gemm.linear(x, gemm.pack(w.contiguous()), 50, b),
                      "strided weight")


def test_one_and_two_threads_give_identical_bits():
    x, w, b = _case(33, 3224, 768, seed=4)
    packed = gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.linear(x, packed, 3224, b)
        torch.set_num_threads(2)
        two = gemm.linear(x, packed, 3224, b)
    finally:
        torch.set_num_threads(threads)
    assert_bits_equal(one, two, "thread count")


def test_declined_calls():
    x, w, b = _case(2, 32, 64, seed=5)
    packed = gemm.pack(w)
    assert gemm.pack(w.double()) is None  # float64 weight
    assert gemm.pack(w.t()) is None  # columns not contiguous
    assert gemm.linear(x.half(), packed, 32, b) is None  # fp16 input for a bf16 weight
    assert gemm.linear(x.float(), packed, 32, b) is None  # float32 input for a bf16 weight
    assert gemm.linear(x, packed, 48, b) is None  # packed for another width
    assert gemm.linear(x, packed, 32, b.float()) is None  # float32 bias
    assert gemm.linear(x, packed, 32, b[:16]) is None  # bias of the wrong length


def test_kernel_linear_layer_and_packing_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 31, bias=False), nn.Linear(48, 8), nn.Linear(31, 5))
    model[0].to(torch.bfloat16)
    model[1].to(torch.bfloat16)
    model[2].to(torch.bfloat16)
    model[2].prepack = False  # a layer that reads its weight directly
    model[3].to(torch.float16)  # fp16, odd in-features
    plain = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in model]
    assert pack_kernel_linear_layers(model) == 3
    assert [type(m) for m in model] == [KernelLinear, KernelLinear, nn.Linear, KernelLinear]
    x = torch.randn(4, 64).to(torch.bfloat16)
    h = model[0](x)
    _assert_matches_exact(h, x, *plain[0])
    h1 = model[1](h)
    _assert_matches_exact(h1, h, *plain[1])
    _assert_matches_exact(model[3](h1.half()), h1.half(), *plain[3])
    with pytest.raises(TypeError, match="bfloat16 CPU input with 64 features"):
        model[0](x.float())


def test_shared_weights_share_one_packed_copy():
    shared = nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    other = nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    other.weight = shared.weight  # tied
    model = nn.ModuleDict({"a": shared, "b": other})
    assert pack_kernel_linear_layers(model) == 2
    assert model["a"].packed_weight.data_ptr() == model["b"].packed_weight.data_ptr()


def _experts(E, H, I, gated, dtype, seed):
    from hybridserve.layers.moe import FusedExperts

    torch.manual_seed(seed)
    block = FusedExperts(E, H, I, "silu" if gated else "relu2", gated=gated)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    block = block.to(dtype)
    reference = FusedExperts(E, H, I, block.act, gated=gated).to(dtype)
    reference.load_state_dict(block.state_dict())
    assert block.pack(gemm.pack) == 2 * E
    return block, reference


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("gated", [True, False], ids=["silu_gated", "relu2"])
@pytest.mark.parametrize("T", [1, 5, 32])
def test_moe_experts_kernel_matches_the_expert_loop(T, gated, dtype):
    """One call for the whole block against FusedExperts' per-expert loop over the same packed linears:
    relu2 bit for bit (the same roundings in the same order); silu within 2 ulps in 16 bits (its exp
    differs by an ulp, which the 16-bit rounding of the activation mostly hides); in float32 nothing hides
    it, and the down projection sums I such differences: within (I + 1) float32 ulps of the largest output."""
    E, H, I, k = 6, 48, 40, 2
    block, _ = _experts(E, H, I, gated, dtype, seed=T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(dtype)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # (T, k) distinct experts
    weight = torch.rand(T, k, generator=g)
    shared = torch.randn(T, H, generator=g).to(dtype)
    got = gemm.moe_experts(x, index, weight, block.tables["gate_up_proj" if gated else "up_proj"],
                           block.tables["down_proj"], I, gated, block.act, shared)
    expected = block._forward_torch(x, index, weight) + shared
    assert got is not None and got.shape == (T, H) and got.dtype == dtype
    if gated and dtype == torch.float32:
        assert_within_ulps(got, expected, dtype, ulps=2, atol=(I + 1) * 2.0 ** -24 * expected.abs().max(),
                           what="moe experts")
    elif gated:
        assert_within_ulps(got, expected, dtype, ulps=2, what="moe experts")
    else:
        assert_bits_equal(got, expected, "moe experts")
    assert torch.equal(block(x, index, weight, shared), got)  # the layer takes the kernel


def test_moe_experts_rejects_bad_indices_and_declines_other_activations():
    block, _ = _experts(4, 16, 8, True, torch.bfloat16, seed=0)
    x = torch.randn(2, 16).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="an expert index outside the block"):
        gemm.moe_experts(x, torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2), block.tables["gate_up_proj"],
                         block.tables["down_proj"], 8, True, "silu")
    assert gemm.moe_experts(x, torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 2), block.tables["gate_up_proj"],
                            block.tables["down_proj"], 8, True, "gelu") is None


@pytest.mark.parametrize("mode", ["topk_then_softmax", "softmax_then_topk"])
def test_router_topk_matches_torch(mode):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 12, generator=g).to(torch.bfloat16)
    index, weight = gemm.router_topk(logits, 3, mode, normalize=True)
    f = logits.float()
    if mode == "topk_then_softmax":
        top, expected_index = f.topk(3, dim=-1)
        expected = top.softmax(-1)
    else:
        expected, expected_index = f.softmax(-1).topk(3, dim=-1)
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(weight, expected, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_one_group_sigmoid_router_matches_torch(bias, eps):
    """The grouped-sigmoid router with one group (LFM2-MoE's): top-k of sigmoid + bias, the chosen scores
    over their sum + eps; against the same in PyTorch."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(11, 16, generator=g)
    correction = torch.randn(16, generator=g) * 0.1 if bias else torch.zeros(16)
    index, weight = gemm.router_grouped_sigmoid(logits, correction, 4, 1, 1, True, 2.5, eps)
    scores = logits.sigmoid()
    expected_index = (scores + correction).topk(4, dim=-1)[1]
    chosen = scores.gather(1, expected_index)
    expected = chosen / (chosen.sum(-1, keepdim=True) + eps) * 2.5
    assert torch.equal(index.sort(-1).values, expected_index.sort(-1).values)
    order_got, order_want = index.argsort(-1), expected_index.argsort(-1)
    torch.testing.assert_close(weight.gather(1, order_got), expected.gather(1, order_want), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_head_linear_f32_matches_einsum(dtype):
    """MLA's absorbed projections: per head ``x[:, h] @ w[h].T`` over a column slice of each head (the
    query's nope part), float32 sums rounded once to the output dtype (within one ulp of the einsum's)."""
    g = torch.Generator().manual_seed(3)
    T, H, K, N = 5, 3, 16, 40
    q = torch.randn(T, H, K + 8, generator=g).to(dtype)  # (T, H, K + rope)
    x = q[..., :K]  # (T, H, K), heads of stride K + 8
    w = torch.randn(H, N, K, generator=g)  # (H, N, K) float32
    out = torch.full((T, H, N), float("nan"), dtype=dtype)
    assert gemm.per_head_linear_f32(x, w, out)
    expected = torch.einsum("thk,hnk->thn", x.float(), w)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert_within_ulps(out, expected.to(dtype), dtype, ulps=1, atol=1e-6)
    untouched = torch.zeros(T, H, N, dtype=dtype)
    assert not gemm.per_head_linear_f32(x, w[:, :, :K - 1].contiguous(), untouched)  # K mismatch
    assert not gemm.per_head_linear_f32(x, w.to(torch.bfloat16), untouched)  # the weight must be float32
    assert not untouched.any()
