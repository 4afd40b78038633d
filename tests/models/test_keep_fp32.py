"""Parameters HF keeps in float32 in a 16-bit model stay float32 here, read from HF's own class attributes."""

from __future__ import annotations

import glob

import pytest
import torch
from safetensors.torch import load_file

from hybridserve import LLM, SamplingParams
from hybridserve.models.loader import float32_parameters
from tests.checkpoints import make


def test_nemotron_h_router_stays_float32_in_a_bf16_model(ckpt_dir):
    path = make(ckpt_dir, "nemotron_h")  # a float32 checkpoint, loaded as bf16
    llm = LLM(path, dtype="bfloat16", mamba_ssm_cache_dtype="float32", enable_progress_bar=False)
    stored = {}
    for file in glob.glob(f"{path}/*.safetensors"):
        stored.update(load_file(file))
    kept = {n: p for n, p in llm.engine.model.named_parameters() if p.dtype == torch.float32}
    router_names = [n.replace("backbone.", "model.", 1) for n in stored
                    if n.endswith(("mixer.gate.weight", "mixer.gate.e_score_correction_bias"))]
    assert router_names and sorted(kept) == sorted(router_names)
    for name, param in kept.items():  # the checkpoint's values, not rounded through bf16
        assert torch.equal(param, stored[name.replace("model.", "backbone.", 1)])
    experts = [p for n, p in llm.engine.model.named_parameters() if "experts" in n]
    assert experts and all(p.dtype == torch.bfloat16 for p in experts)
    out = llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 77]}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_keep_rules_follow_hf(dtype):
    from transformers import BambaConfig, NemotronHConfig

    names = ["model.layers.2.mixer.gate.weight", "model.layers.2.mixer.gate.e_score_correction_bias",
             "model.layers.2.mixer.gate_proj.weight", "model.layers.0.mixer.in_proj.weight"]
    nemotron = NemotronHConfig(architectures=["NemotronHForCausalLM"])
    want = names[:2] if dtype != torch.float32 else []
    assert float32_parameters(nemotron, dtype, names) == want  # "gate.weight" is not "gate_proj.weight"
    assert float32_parameters(BambaConfig(architectures=["BambaForCausalLM"]), dtype, names) == []
