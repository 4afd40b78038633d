"""The MoE experts kernel (``hs_moe_experts``) on the routings that pick its paths: decode-sized calls (experts
in parallel, one thread each), one of them with an expert of more than two 16-row tile groups, and
prefill-sized calls (one expert at a time), each with its vectorized weighted token sums: the same bits as
the per-expert loop over the same packed linears, whatever the thread count."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import gemm
from tests.kernels.helpers import assert_bits_equal, assert_within_ulps, needs_compiler, random_experts

pytestmark = [needs_compiler, pytest.mark.usefixtures("isa_level")]


def _block(E, H, I, gated, seed):
    block = random_experts(E, H, I, gated, seed)
    assert block.pack(gemm.pack) == 2 * E
    return block


def _routing(T, E, k, crowded, g):
    """(T, k) distinct experts per token; with ``crowded``, every token's first expert is expert 0."""
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if crowded:
        index = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(E - 1, generator=g)[:k - 1] + 1])
                             for _ in range(T)])
    return index


def _kernel(block, x, index, weight, shared):
    up = block.tables["gate_up_proj" if block.gated else "up_proj"]
    return gemm.moe_experts(x, index, weight, up, block.tables["down_proj"], block.intermediate_size, block.gated,
                            block.act, shared)


# T x k against 16 x the active experts picks the path: 40 tokens crowding one expert of 8 stay decode-sized
# (one expert with 40 rows: two tile groups and a partial one); 400 tokens are prefill-sized.
@pytest.mark.parametrize("gated", [True, False], ids=["silu_gated", "relu2"])
@pytest.mark.parametrize("T, crowded", [(40, True), (7, False), (400, False)], ids=["crowded", "few", "prefill"])
def test_moe_experts_kernel_matches_the_expert_loop_on_every_path(T, crowded, gated):
    """relu2 bit for bit against the per-expert loop (the same roundings in the same order); silu within 2
    bf16 ulps (the kernel's exp differs from PyTorch's by an ulp, mostly hidden by the rounding)."""
    E, H, I, k = 8, 100, 36, 2  # H: the vectorized token sums end in a partial vector
    block = _block(E, H, I, gated, seed=T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    index = _routing(T, E, k, crowded, g)
    weight = torch.rand(T, k, generator=g)
    shared = torch.randn(T, H, generator=g).to(torch.bfloat16)
    got = _kernel(block, x, index, weight, shared)
    expected = block._forward_torch(x, index, weight) + shared
    assert got is not None and got.shape == (T, H)
    if gated:
        assert_within_ulps(got, expected, torch.bfloat16, ulps=2, what="moe experts")
    else:
        assert_bits_equal(got, expected, "moe experts")


@pytest.mark.parametrize("T, crowded", [(40, True), (400, False)], ids=["decode", "prefill"])
def test_moe_experts_kernel_bits_do_not_depend_on_threads(T, crowded):
    """One thread and two give the same bits, whichever thread runs which expert or linear block."""
    E, H, I, k = 8, 96, 32, 2
    block = _block(E, H, I, True, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    index = _routing(T, E, k, crowded, g)
    weight = torch.rand(T, k, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernel(block, x, index, weight, None)
        torch.set_num_threads(2)
        two = _kernel(block, x, index, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert one is not None and two is not None
    assert_bits_equal(two, one, "moe experts on two threads against one")
