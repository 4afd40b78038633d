"""What the engine accepts in config.json: a config naming only its model_type, and a max_model_len past the
model's trained positions (accepted with a warning)."""

import json
import logging
import os
import shutil

import pytest

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make


def test_config_with_model_type_only_loads_as_its_architecture(ckpt_dir, tmp_path):
    path = make(ckpt_dir, "bamba")
    bare = str(tmp_path / "bare")
    shutil.copytree(path, bare)
    with open(os.path.join(bare, "config.json")) as f:
        config = json.load(f)
    assert config.pop("architectures") == ["BambaForCausalLM"]
    with open(os.path.join(bare, "config.json"), "w") as f:
        json.dump(config, f)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [4, 5, 6, 7]}]
    want = LLM(path, cache_memory="8MiB", enable_progress_bar=False).generate(prompt, params)
    got = LLM(bare, cache_memory="8MiB", enable_progress_bar=False).generate(prompt, params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    config["model_type"] = "no-such-family"
    with open(os.path.join(bare, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError):
        LLM(bare, cache_memory="8MiB")


def test_max_model_len_past_the_positions_warns(ckpt_dir, caplog):
    path = make(ckpt_dir, "llama")
    with open(os.path.join(path, "config.json")) as f:
        positions = json.load(f)["max_position_embeddings"]
    with caplog.at_level(logging.WARNING, logger="hybridserve"):
        LLM(path, cache_memory="8MiB", max_model_len=positions * 2, enable_progress_bar=False)
    lines = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert lines and f"max_model_len={positions * 2}" in lines[0] and f"={positions}" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridserve"):
        LLM(path, cache_memory="8MiB", max_model_len=positions, enable_progress_bar=False)
    assert not [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
