"""oneDNN-prepacked bf16 linears: the engine's results are bit-identical with and without them."""

import os

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.kernels import gemm
from hybridserve.layers.packed_linear import PackedLinear, prepack_available
from tests.checkpoints import make

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN prepack")


@pytest.mark.parametrize("family", ["bamba", "zamba2", "mamba2", "jamba"])
def test_prepacked_bf16_linears_are_bit_identical(ckpt_dir, family):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    prompts = [{"prompt_token_ids": [5, 9, 17, 3, 40, 41]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    # the CPU kernels off: their own linear layers would take these weights instead of oneDNN
    packed = LLM(path, cache_memory="8MiB", cpu_kernels=False)
    plain = LLM(path, cache_memory="8MiB", cpu_weight_prepack=False, cpu_kernels=False)
    assert any(isinstance(m, PackedLinear) for m in packed.engine.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.engine.model.modules())
    a, b = packed.generate(prompts, params), plain.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in ex.items()} == {t: lp.logprob for t, lp in ey.items()}


def test_float32_models_are_not_packed(ckpt_dir):
    llm = LLM(make(ckpt_dir, "bamba"), cache_memory="8MiB")
    assert not any(isinstance(m, PackedLinear) for m in llm.engine.model.modules())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc to see memory maps")
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_packed_models_release_the_checkpoint_memory_map(ckpt_dir, cpu_kernels):
    """Loaded weights are views of the safetensors file's memory map; once the linears are packed, the
    other weights get their own copies, so the file is no longer mapped (nor its pages resident)."""
    path = make(ckpt_dir, "granitemoehybrid", dtype=torch.bfloat16)
    llm = LLM(path, cache_memory="8MiB", cpu_kernels=cpu_kernels)
    weights = os.path.realpath(os.path.join(path, "model.safetensors"))
    with open("/proc/self/maps") as maps:
        assert weights not in maps.read()
    out = llm.generate([{"prompt_token_ids": [5, 9, 17]}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_huge_page_tensors_start_on_a_boundary():
    from hybridserve.kernels import hugepages

    big = hugepages.empty(3 * hugepages.HUGE_PAGE // 2 + 7, torch.bfloat16)  # 3 MiB and a bit
    assert big.numel() == 3 * hugepages.HUGE_PAGE // 2 + 7 and big.dtype == torch.bfloat16 and big.is_contiguous()
    if hugepages._madvise() is not None:
        assert big.data_ptr() % hugepages.HUGE_PAGE == 0
    big.fill_(1.5)  # the whole tensor is writable
    small = hugepages.empty(1000, torch.float32)
    assert small.numel() == 1000 and small.dtype == torch.float32


@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build: no kernel packing")
def test_kernel_packing_shares_one_arena_and_matches_pack():
    """Every packed weight is a cache-line-aligned slice of one allocation, equal to ``gemm.pack`` of
    its weight; a tied head shares its embedding's packing."""
    from hybridserve.layers.packed_linear import KernelLinear, pack_kernel_linear_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 96, bias=False),
                                torch.nn.Linear(96, 33)).to(torch.bfloat16)
    tied = torch.nn.Linear(64, 48).to(torch.bfloat16)
    tied.weight = model[0].weight
    model.append(tied)
    weights = [m.weight.detach().clone() for m in model]
    assert pack_kernel_linear_layers(model) == 4
    packed = [m.packed_weight for m in model]
    assert all(isinstance(m, KernelLinear) for m in model)
    assert packed[3] is packed[0]
    bases = {p.untyped_storage().data_ptr() for p in packed}
    assert len(bases) == 1, "the packed weights are not one allocation"
    for w, p in zip(weights, packed):
        assert p.data_ptr() % 64 == 0
        assert torch.equal(p, gemm.pack(w))
