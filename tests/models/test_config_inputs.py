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


# ------------------------------------------------------------------ config values checked before anything is built
def _with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize("key,value,needle", [
    ("num_attention_heads", 0, "num_attention_heads=0 must be a positive integer"),
    ("hidden_size", "64", "hidden_size='64' must be a positive integer"),
    ("hidden_size", 64.0, "hidden_size=64.0 must be a positive integer"),
    ("num_key_value_heads", -2, "num_key_value_heads=-2 must be a positive integer"),
    ("mamba_d_state", None, None),  # null: the config class's default applies
    ("num_local_experts", "many", "num_local_experts='many' must be an integer"),
    ("num_nextn_predict_layers", -1, "num_nextn_predict_layers=-1 must not be negative"),
    ("dtype", "float128", "dtype='float128' is not a dtype this engine knows; allowed values: float32, bfloat16, "
                          "float16"),
    ("torch_dtype", 16, "torch_dtype=16 is not a dtype"),
], ids=lambda v: repr(v)[:24])
def test_bad_config_values_are_one_line_errors(ckpt_dir, tmp_path, key, value, needle):
    from hybridserve.models.loader import load_hf_config

    path = _with_config(make(ckpt_dir, "bamba"), tmp_path / "bad", **{key: value})
    if needle is None:
        assert load_hf_config(path).hidden_size == 64
        return
    with pytest.raises(ValueError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(os.path.join(path, "config.json") + ": ") and needle in message


def test_text_config_values_are_checked():
    from hybridserve.models.config_checks import check_config_values

    with pytest.raises(ValueError, match=r"^c.json: text_config.num_attention_heads=0 must be a positive integer$"):
        check_config_values({"text_config": {"num_attention_heads": 0}}, "c.json")


def _shipped_config(dst, **changes) -> str:
    """A directory holding the shipped model's config.json with ``changes`` (no weights: none are read)."""
    from hybridserve.default_model import default_model_path

    os.makedirs(dst)
    with open(os.path.join(default_model_path(), "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def test_a_million_layers_are_refused_at_once(tmp_path, monkeypatch):
    """The shipped model's config with 10**6 layers. Before: transformers' config class alone took half a minute,
    and building the model hung."""
    import time

    from hybridserve.models import config_checks
    from hybridserve.models.loader import load_hf_config

    monkeypatch.setattr(config_checks, "available_memory", lambda: 128 * 2**30)
    path = _shipped_config(tmp_path / "deep", num_hidden_layers=10**6)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"config.json: the weights of 1000000 layers of hidden_size=256 and "
                                         r"vocab_size=4096 need at least 244\.1 GiB \(131,073,048,576 parameters at "
                                         r"2 bytes\), more than the 128\.0 GiB of memory available"):
        load_hf_config(path)
    assert time.perf_counter() - start < 1.0


def test_weights_beyond_this_machines_memory_are_refused(tmp_path):
    """The real available-memory reading: 10**9 layers need more than any machine has."""
    from hybridserve.models.config_checks import available_memory
    from hybridserve.models.loader import load_hf_config

    assert available_memory() is not None and available_memory() > 0
    with pytest.raises(ValueError, match=r"need at least .* GiB .*, more than the .* GiB of memory available"):
        load_hf_config(_shipped_config(tmp_path / "deeper", num_hidden_layers=10**9))


def test_the_shipped_model_fits():
    from hybridserve.default_model import default_model_path
    from hybridserve.models import config_checks

    with open(os.path.join(default_model_path(), "config.json")) as f:
        values = json.load(f)
    config_checks.check_config_values(values, "config.json")  # no error
    assert config_checks.estimated_parameters(values) == 4096 * 256 + 6 * 2 * 256 * 256


def test_layer_count_from_per_layer_lists():
    from hybridserve.models.config_checks import layer_count

    assert layer_count({"hybrid_override_pattern": "M-M*-"}) == 5
    assert layer_count({"layers_block_type": ["mamba"] * 7, "num_hidden_layers": 3}) == 7
    assert layer_count({"hidden_size": 8}) is None


def test_parameter_estimate_is_a_lower_bound_for_every_family():
    """The memory check never refuses a model that fits: for each family's test config, the estimate is at most
    the parameters of the model built from it (on the meta device: nothing allocated)."""
    import torch

    from hybridserve.cache.spec import CacheDtypes
    from hybridserve.config import EngineConfig
    from hybridserve.models import config_checks
    from hybridserve.models.loader import architecture_of, served_text_config
    from hybridserve.models.registry import model_class
    from tests.checkpoints import BUILDERS, VL_BUILDERS

    for family, builder in {**BUILDERS, **VL_BUILDERS}.items():
        hf_config = builder()
        estimate = config_checks.estimated_parameters(json.loads(hf_config.to_json_string()))
        text = served_text_config(hf_config)
        dtypes = CacheDtypes.from_resolved(EngineConfig(model="unused").resolve_dtypes(text))
        with torch.device("meta"):
            model = model_class(architecture_of(text))(text, dtypes)
        actual = sum(p.numel() for p in model.parameters())
        assert estimate is not None and 0 < estimate <= actual, (family, estimate, actual)


def test_a_value_transformers_rejects_is_one_line(ckpt_dir, tmp_path):
    from hybridserve.models.loader import load_hf_config

    path = _with_config(make(ckpt_dir, "bamba"), tmp_path / "bad", rms_norm_eps="small")
    with pytest.raises(ValueError, match=r"config.json: transformers rejects this config \(.*rms_norm_eps") as info:
        load_hf_config(path)
    assert "\n" not in str(info.value)


def test_a_config_the_model_cannot_be_built_from_is_a_value_error(ckpt_dir, tmp_path):
    path = _with_config(make(ckpt_dir, "bamba"), tmp_path / "bad", hidden_act="no-such-activation")
    with pytest.raises(ValueError, match=r"does not describe a buildable BambaForCausalLM: KeyError: "
                                         r"'no-such-activation'"):
        LLM(path, cache_memory="8MiB")


@pytest.mark.parametrize("changes,needle", [
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
    ({"dtype": "float128"}, "dtype='float128' is not a dtype"),
    ({"num_hidden_layers": 10**9}, "of memory available"),
], ids=["heads", "dtype", "layers"])
def test_cli_prints_one_error_line_and_exits_2(tmp_path, capsys, changes, needle):
    from hybridserve.entrypoints.cli import main

    path = _shipped_config(tmp_path / "bad", **changes)
    assert main(["generate", "hello", "--model", path, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1


def test_planning_skips_the_memory_check(monkeypatch):
    """``hybridserve plan`` may plan for a bigger machine: it reads the config without the memory check."""
    from hybridserve.default_model import default_model_path
    from hybridserve.models import config_checks
    from hybridserve.models.loader import load_hf_config
    from hybridserve.planning.planner import load_config

    monkeypatch.setattr(config_checks, "available_memory", lambda: 1024)
    with pytest.raises(ValueError, match="more than the 0.0 GiB of memory available"):
        load_hf_config(default_model_path())
    assert load_config(default_model_path()).num_hidden_layers == 6


def test_serve_prints_one_error_line_and_exits_2(tmp_path, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from hybridserve.entrypoints.cli import main

    path = _shipped_config(tmp_path / "bad", hidden_size="256")
    assert main(["serve", path, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {os.path.join(path, 'config.json')}: hidden_size='256' must be a positive integer"
    assert not any("Traceback" in line for line in err)
