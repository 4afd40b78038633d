"""``quantization="int4"`` end to end: every linear, MoE experts and the LM head in 4 bits on the kernels, the decode
captured with no fallback, the option validated and on the CLI, ``hybridserve plan``'s int4 estimate equal to the
engine's figure.

Accuracy reference: 4-bit rounding moves a tiny random model's logprobs far more than a near tie (docs/
quantization.md gives the shipped model's figures), so the int4 run is compared with a bf16 run of the same
checkpoint whose quantized tensors were replaced by their 4-bit values (``quantize_w4_sub`` then
``dequantize_w4``, rounded to bf16): the same weights, so the two must agree within the near-tie rule of
``test_int8_weights.py`` (the kernels sum in float32, the vector path over the exact float32 weights)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import fallbacks, gemm
from hybridserve.layers.linear_w4 import quantize_w4_sub
from hybridserve.ops.linear_w4 import dequantize_w4
from tests.checkpoints import make
from tests.kernels.helpers import needs_compiler
from tests.layers.test_int8_weights import _run, compare_near_tie

#: mean |Δlogprob| against the same 4-bit weights in bf16: the gap is the weights' bf16 rounding on one side and
#: the sums' order (observed 0.01-0.03, as int8 against bf16's own weights)
MEAN_DELTA_BOUND = 0.1
#: four prompts: a tiny random model's near ties end a comparison early, so two prompts may leave under 20 steps
PROMPT_LENGTHS = (5, 19, 12, 33)
_KEPT = re.compile(r"(embed|router|\.gate\.weight$|conv1d|norm|_scale)")


def _dequantized_copy(path: str, group: int) -> str:
    """The checkpoint at ``path`` with every tensor the engine makes 4-bit replaced by its 4-bit value in bf16."""
    out = f"{path}-w4sub{group}"
    if os.path.isdir(out):
        return out
    os.makedirs(out)
    for name in os.listdir(path):
        src = os.path.join(path, name)
        if name.endswith(".safetensors"):
            tensors = load_file(src)
            for key, t in tensors.items():
                if t.dim() in (2, 3) and not _KEPT.search(key) and t.shape[-1] % 8 == 0:
                    rows = t.reshape(-1, t.shape[-1])
                    codes, scales, _ = quantize_w4_sub(rows, group)
                    tensors[key] = dequantize_w4(codes, scales, None, group).to(t.dtype).reshape(t.shape)
            save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        elif os.path.isfile(src):
            with open(src, "rb") as f, open(os.path.join(out, name), "wb") as g:
                g.write(f.read())
    return out


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
@pytest.mark.parametrize("family,group", [("granitemoehybrid", 32), ("mamba2", 64), ("bamba", 32)])
def test_int4_weights_equal_their_dequantized_values(ckpt_dir, family, group):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    _, reference = _run(_dequantized_copy(path, group), PROMPT_LENGTHS, quantization="none")
    declined = fallbacks.total()
    llm, run = _run(path, PROMPT_LENGTHS, quantization="int4", quantization_group_size=group)
    paths = llm.engine.cpu_fast_paths
    assert paths.quantization == "int4" and paths.w4_linears > 0 and not paths.w8_linears
    assert paths.decode_captured, paths.decode_reason
    assert fallbacks.total() == declined, fallbacks.counts()
    assert paths.torch_16bit_linears == 0
    mean, steps = compare_near_tie(run, reference)
    print(f"\nint4 vs its dequantized weights in bf16, {family}: mean |dlogprob| {mean:.4f} over {steps} steps")
    assert steps >= 20 and mean <= MEAN_DELTA_BOUND, (family, mean, steps)


def test_quantization_group_size_is_validated_and_on_the_cli():
    assert EngineConfig(model="x", quantization="int4").quantization_group_size == 32  # the default, resolved
    assert EngineConfig(model="x", quantization="int4", quantization_group_size=64).int4_group_size() == 64
    assert EngineConfig(model="x", quantization="int8").quantization_group_size is None
    with pytest.raises(ValueError, match=r"quantization_group_size=48 \(--quantization-group-size\) must be one of "
                                         r"32, 64, 128"):
        EngineConfig(model="x", quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match=r"applies to quantization='int4' only, got quantization='int8'"):
        EngineConfig(model="x", quantization="int8", quantization_group_size=32)
    with pytest.raises(ValueError, match="cpu_kernels=True"):
        EngineConfig(model="x", quantization="int4", cpu_kernels=False)
    fingerprints = {EngineConfig(model="x", quantization="int4", quantization_group_size=g).fingerprint()
                    for g in (32, 64)}
    assert len(fingerprints) == 2
    args = build_parser().parse_args(["generate", "some/dir", "--quantization", "int4",
                                      "--quantization-group-size", "64"])
    config = EngineConfig(**{**engine_kwargs(args), "model": "x"})
    assert (config.quantization, config.quantization_group_size) == ("int4", 64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "some/dir", "--quantization-group-size", "48"])


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
def test_plan_int4_estimate_is_the_engine_figure(ckpt_dir, capsys):
    from hybridserve.entrypoints.cli import main

    path = make(ckpt_dir, "granitemoehybrid", dtype=torch.bfloat16)
    assert main(["plan", path, "--json", "--quantization-group-size", "64"]) == 0
    weights = json.loads(capsys.readouterr().out)["weight_bytes"]
    llm, _ = _run(path, quantization="int4", quantization_group_size=64)
    engine = llm.cache_layout()["weight_bytes"]
    # (the engine's float32 bytes are the routers' float32 copies, which the estimate leaves out)
    assert weights["int4"]["int4"] == engine["int4"] and weights["int4"]["bfloat16"] == engine["bfloat16"]
    assert sum(weights["int4"].values()) < sum(weights["int8"].values())
    assert main(["plan", path]) == 0
    assert "with --quantization int4, groups of 32 (estimate)" in capsys.readouterr().out


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
def test_env_with_int4_weights_names_the_4_bit_kernel(ckpt_dir, capsys):
    from hybridserve.entrypoints.cli import main

    path = make(ckpt_dir, "granitemoehybrid", dtype=torch.bfloat16)
    assert main(["env", "--json", "--model", path, "--quantization", "int4"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = report["model"]
    assert model["weights"]["quantization"] == "int4" and model["weights"]["4bit"]["linears"] > 0
    assert model["weights"]["4bit"]["kernel"] == report["kernels"]["ops"]["linear_w4"]["variant"]
    assert model["decode"]["captured"] and model["kernel_fallbacks"] == []
