"""What ``hybridserve generate`` does at start: the activations taken without ``transformers.activations`` are
HF's own to the bit, that import stays off the engine's path, and the command captures decode steps only for
as many sequences as it has prompts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers.activations import ACT2FN

from hybridserve.layers.activations import PLAIN, activation

CHECK_IMPORTS = """
import sys
from hybridserve.config import EngineConfig
from hybridserve.default_model import default_model_path
from hybridserve.engine.llm_engine import LLMEngine
LLMEngine(EngineConfig(model=default_model_path(), device="cpu", cache_memory="64MiB", max_num_seqs=1,
                       enable_progress_bar=False))
print("transformers.activations" in sys.modules)
"""


@pytest.mark.parametrize("name", sorted(PLAIN))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_activations_are_hfs(name, dtype):
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)  # (4096,)
    ours, theirs = activation(name)(x), ACT2FN[name](x)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_other_activations_come_from_hf():
    x = torch.linspace(-4, 4, 101)
    assert torch.equal(activation("gelu_pytorch_tanh")(x), ACT2FN["gelu_pytorch_tanh"](x))
    with pytest.raises(KeyError):
        activation("no-such-activation")


def test_engine_start_skips_transformers_activations():
    result = subprocess.run([sys.executable, "-c", CHECK_IMPORTS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_generate_captures_only_as_many_rows_as_prompts(monkeypatch, capsys):
    from hybridserve.engine import llm_engine
    from hybridserve.entrypoints.cli import main

    seen = []
    real = llm_engine.LLMEngine.__init__

    def spy(self, config):
        seen.append(config.max_num_seqs)
        real(self, config)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", spy)
    assert main(["generate", "Once upon a time", "The fox", "--max-tokens", "3", "--device", "cpu"]) == 0
    assert main(["generate", "Once", "--max-tokens", "3", "--device", "cpu", "--max-num-seqs", "8"]) == 0
    assert seen == [2, 1]
    out = capsys.readouterr().out
    assert out.startswith("[0] Once upon a time") and "[1] The fox" in out


def test_fewer_captured_rows_generate_the_same_tokens():
    from hybridserve.config import EngineConfig
    from hybridserve.default_model import default_model_path
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.sampling_params import SamplingParams

    outputs = []
    for rows in (64, 1):
        engine = LLMEngine(EngineConfig(model=default_model_path(), device="cpu", cache_memory="64MiB",
                                        max_num_seqs=rows, enable_progress_bar=False))
        engine.add_request("r", engine.detokenizer.encode("Once upon a time"),
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append(out.outputs[0].token_ids)
    assert len(outputs[0]) == 24 and outputs[0] == outputs[1]
