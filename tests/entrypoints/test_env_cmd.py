"""``hybridserve env``: the machine, the ISA in force and each op's kernel variant; with a model, its
fast paths (decode captured, or why not) and the kernel fallbacks of a short generation. Also the
engine's ``cpu_isa`` cap end to end."""

from __future__ import annotations

import json

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.entrypoints.cli import main
from hybridserve.kernels import build, gemm, isa
from tests.checkpoints import BUILDERS, make

needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler")


def _env(capsys, *args) -> dict:
    previous = isa.cap()
    try:
        assert main(["env", "--json", *args]) == 0
    finally:
        isa.set_cap(previous)
    return json.loads(capsys.readouterr().out)


def test_env_reports_the_cpu_versions_and_every_op(capsys):
    report = _env(capsys)
    info = isa.cpu_info()
    assert report["cpu"]["best_isa"] == info.best_level and report["cpu"]["arch"] == info.arch
    assert set(report["cpu"]["features"]) == set(isa.REPORTED_FEATURES)
    assert report["isa"]["in_force"] == isa.level_in_force()
    assert report["versions"]["torch"] == torch.__version__
    ops = report["kernels"]["ops"]
    assert {"linear_bf16", "linear_f16", "mamba2_scan", "paged_attention", "graph_replay"} <= set(ops)
    for row in ops.values():  # a variant, or the fallback with its reason
        assert (row["fallback_reason"] is None) != (row["variant"] == "plain PyTorch")


@needs_compiler
def test_env_follows_the_isa_cap(capsys):
    report = _env(capsys, "--cpu-isa", "generic")
    assert report["isa"]["in_force"] == "generic" and report["isa"]["cap"] == "generic"
    assert report["kernels"]["ops"]["linear_bf16"]["variant"].startswith("generic: weights widened")


@needs_compiler
def test_env_with_a_model_reports_its_capture_and_fallbacks(capsys, ckpt_dir):
    covered = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    report = _env(capsys, "--model", covered, "--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32")
    assert report["model"]["decode"] == {"captured": True, "reason": None}
    assert report["model"]["kernel_fallbacks"] == []
    assert report["model"]["linears"]["torch_16bit"] == 0 and report["model"]["linears"]["hybridserve_kernel"] > 0
    eager = _env(capsys, "--model", covered, "--dtype", "bfloat16", "--enforce-eager")["model"]
    assert eager["decode"] == {"captured": False, "reason": "--enforce-eager"}
    fp8 = _env(capsys, "--model", covered, "--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3")["model"]
    assert fp8["decode"]["captured"] is False and "aten." in fp8["decode"]["reason"]  # the operators, named
    ops = {row["op"] for row in fp8["kernel_fallbacks"]}
    assert {"kv_write", "paged_attention"} <= ops and all(row["calls"] > 0 for row in fp8["kernel_fallbacks"])


def test_env_with_int8_weights_reports_the_kernel_and_a_captured_decode(capsys, ckpt_dir):
    path = make(ckpt_dir, "granitemoehybrid", dtype=torch.bfloat16)
    report = _env(capsys, "--model", path, "--quantization", "int8")
    model = report["model"]
    assert model["decode"] == {"captured": True, "reason": None} and model["kernel_fallbacks"] == []
    assert model["weights"]["quantization"] == "int8" and model["linears"]["8bit"]["int8"] > 0
    assert model["weights"]["kernel"] == report["kernels"]["ops"]["linear_w8"]["variant"]
    assert report["isa"]["in_force"] in model["weights"]["kernel"]


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
def test_engine_capped_to_generic_matches_the_level_in_force(ckpt_dir):
    """A bf16 model at the generic level (the portable kernels, no x86 extension) and at the CPU's own
    level: both run every linear on the packed kernels, and their greedy tokens agree."""
    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3]}]
    previous = isa.cap()
    try:
        outs = {}
        for level in ("generic", "auto"):
            llm = LLM(path, dtype="bfloat16", cpu_isa=level, cache_memory="16MiB", enable_progress_bar=False)
            report = llm.engine.cpu_fast_paths
            assert report.isa == (isa.cpu_info().best_level if level == "auto" else level)
            assert report.torch_16bit_linears == 0 and report.decode_captured
            outs[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        isa.set_cap(previous)
    assert outs["generic"] == outs["auto"]


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_env_reports_every_family_captured_without_fallbacks(capsys, ckpt_dir, family):
    """The acceptance check: a bf16 checkpoint of every family with a float32 SSM state has its decode
    captured, and a short generation (prefill and decode) sends no call to plain PyTorch."""
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    model = _env(capsys, "--model", path, "--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32")["model"]
    assert model["decode"] == {"captured": True, "reason": None}
    assert model["kernel_fallbacks"] == []
