"""``hybridserve plan``: every family planned at its config class's defaults and at the variants published configs
use, the torch-free options against EngineConfig, the grouped table, model_type-only configs and the length
warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from hybridserve.cache import dtypes as dtype_names
from hybridserve.cache.spec import CacheDtypes, dtype_size
from hybridserve.config import KV_CACHE_DTYPES, MODEL_DTYPES, STATE_DTYPES, EngineConfig
from hybridserve.config import parse_size as engine_parse_size
from hybridserve.default_model import default_model_path
from hybridserve.entrypoints.cli import main
from hybridserve.models import registry
from hybridserve.models.loader import served_text_config
from hybridserve.models.registry import model_class, supported_architectures
from hybridserve.planning.plan_config import PlanConfig, parse_size
from hybridserve.planning.planner import (
    DEFAULT_MAX_MODEL_LEN,
    cache_specs_from_config,
    load_config,
    max_positions,
    plan_cache,
)
from tests.checkpoints import BUILDERS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: distinct dtypes per role, so a role mixed up shows
TORCH_ROLES = CacheDtypes(kv=torch.bfloat16, conv=torch.float16, temporal=torch.float32)
#: the same distinct dtypes as plan options
ROLES_OPTIONS = PlanConfig(device="cpu", kv_cache_dtype="bfloat16", mamba_cache_dtype="float16",
                           mamba_ssm_cache_dtype="float32")
#: configs beyond the test checkpoints: legacy spellings and keys left to their defaults
VARIANTS = {
    "nemotron_h-pattern": ("nemotron_h", {"hybrid_override_pattern": "M*-EM*", "num_hidden_layers": 6,
                                          "mamba_n_groups": 2, "hidden_size": 64, "mamba_num_heads": 4,
                                          "mamba_head_dim": 16, "ssm_state_size": 8}),
    "lfm2-full_attn_idxs": ("lfm2", {"full_attn_idxs": [1, 3], "num_hidden_layers": 5, "hidden_size": 64}),
    "qwen3_next-no-layer_types": ("qwen3_next", {"num_hidden_layers": 8}),
    "zamba2-long-context": ("zamba2", {"use_long_context": True, "hidden_size": 64, "num_attention_heads": 4,
                                       "num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "mamba"]}),
    "falcon_h1-no-d_ssm": ("falcon_h1", {"mamba_d_ssm": None, "hidden_size": 64, "mamba_n_heads": 8,
                                         "num_hidden_layers": 2}),
    "bamba-no-kv-heads": ("bamba", {"num_key_value_heads": None, "attn_layer_indices": [0], "num_hidden_layers": 2}),
    "jamba-attention-period": ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 1, "num_hidden_layers": 4}),
    "minimax-sliding": ("minimax", {"sliding_window": 64, "num_hidden_layers": 4}),
    "qwen3_5_moe-vl-text_config": ("qwen3_5_moe", {"text_config": {  # served as text: text_config is the model
        "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "linear_num_value_heads": 48, "num_key_value_heads": 4, "max_position_embeddings": 262144}}),
    # derived defaults: linear head sizes from hidden / heads, KV heads = heads, attention only on the last layer
    "olmo_hybrid-derived": ("olmo_hybrid", {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4}),
    # xLSTM-7b's spellings: embedding_dim and num_blocks beside hidden_size and num_hidden_layers, narrower qk heads
    "xlstm-blocks": ("xlstm", {"embedding_dim": 256, "hidden_size": 256, "num_blocks": 3, "num_hidden_layers": 3,
                               "num_heads": 4, "qk_dim_factor": 0.25}),
}


def _write(path, values: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(values))
    return str(path)


def _case(name: str) -> dict:
    """The config.json of a case: a test checkpoint's config with only the keys it changes (so every other key
    is the family's default), a family's defaults alone, or a variant."""
    if name in BUILDERS:
        config = BUILDERS[name]()
    else:
        model_type, overrides = VARIANTS[name] if name in VARIANTS else (name.removeprefix("defaults-"), {})
        config = type(AutoConfig.for_model(model_type))(**overrides)
    values = config.to_diff_dict()
    values["model_type"] = config.model_type
    if not values.get("architectures") and config.model_type in registry.model_types():
        values["architectures"] = [registry.model_types()[config.model_type]]
    return values


def _described(specs) -> list:
    return [(s.describe(), s.attention.sliding_window if s.attention is not None else None) for s in specs]


CASES = [*BUILDERS, *(f"defaults-{t}" for t in registry.model_types() if t != "lfm2_moe"),
         *VARIANTS]


#: what a variant must decode to: each cache layer's kind, and the trained positions
VARIANT_EXPECTED = {
    "nemotron_h-pattern": (["mamba2", "attention", "mamba2", "attention"], 4096),  # "M*-EM*": layers 0 1 4 5
    "lfm2-full_attn_idxs": (["short_conv", "attention", "short_conv", "attention", "short_conv"], 128000),
    "zamba2-long-context": (["mamba2", "attention+mamba2", "mamba2"], 16384),  # the class sets it, not the file
    "jamba-attention-period": (["mamba", "attention", "mamba", "attention"], 262144),
    "olmo_hybrid-derived": (["gated_delta_net", "gated_delta_net", "attention"], 65536),  # attention on the last
}


@pytest.mark.parametrize("name", CASES)
def test_every_family_plans_at_defaults_and_variants(tmp_path, name):
    """Each case's config.json (a test checkpoint, a config class's defaults alone, or a variant) plans through
    transformers' config and the model built on the meta device: one spec per cache layer with distinct indices,
    the dtypes by role, and the served config's trained positions (the variants' decoding checked exactly)."""
    values = _case(name)
    path = _write(tmp_path / name, values)
    hf_config = load_config(path)
    specs = cache_specs_from_config(hf_config, ROLES_OPTIONS.resolve_dtypes(hf_config))
    assert specs and len({s.index for s in specs}) == len(specs)
    for spec in specs:
        if spec.attention is not None:
            assert spec.attention.dtype == "bfloat16"
    served = served_text_config(AutoConfig.from_pretrained(path))
    assert max_positions(hf_config) == getattr(served, "max_position_embeddings", None)
    if name in VARIANT_EXPECTED:
        kinds, positions = VARIANT_EXPECTED[name]
        assert [s.kind for s in specs] == kinds
        assert max_positions(hf_config) == positions
    if name == "minimax-sliding":
        assert {s.attention.sliding_window for s in specs if s.attention is not None} == {64}


def test_every_family_record_is_complete():
    """Each built-in record runs tensor-parallel, names its model class and claims its own model types (no
    model_type maps to two families)."""
    records = registry.families()
    assert len(records) == len(supported_architectures()) == 22
    claimed = [t for r in records for t in r.model_types]
    assert len(claimed) == len(set(claimed)) == len(registry.model_types())
    for record in records:
        assert record.tensor_parallel and record.model_types, record
        assert model_class(record.architecture).__name__ == record.model_class_name


def test_a_registered_architecture_plans_as_the_family_it_reuses(tmp_path, monkeypatch):
    """A registered architecture (``registry.register``) is planned from its model class, with the same figures
    as the built-in family whose class it names."""
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))  # registered for this test only
    registry.register("OtherLlamaForCausalLM", "hybridserve.models.llama", "LlamaForCausalLM")
    values = _case("llama")
    known = _write(tmp_path / "known", values)
    other = _write(tmp_path / "other", {**values, "architectures": ["OtherLlamaForCausalLM"]})
    by_family = plan_cache(load_config(known), PlanConfig(device="cpu")).to_dict()
    by_model = plan_cache(load_config(other), PlanConfig(device="cpu")).to_dict()
    assert by_model.pop("architecture") == "OtherLlamaForCausalLM"
    by_family.pop("architecture")
    assert by_model == by_family


def test_lfm2_moe_without_layer_types_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "m", {"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe"})
    with pytest.raises(ValueError, match="layer_types"):
        hf_config = load_config(path)
        cache_specs_from_config(hf_config, ROLES_OPTIONS.resolve_dtypes(hf_config))


def test_dtype_names_and_sizes_match_torch():
    assert dtype_names.MODEL_DTYPE_NAMES == tuple(MODEL_DTYPES)
    assert dtype_names.KV_CACHE_DTYPE_NAMES == tuple(KV_CACHE_DTYPES)
    assert dtype_names.STATE_DTYPE_NAMES == tuple(STATE_DTYPES)
    for name, dtype in KV_CACHE_DTYPES.items():
        assert dtype_size(name) == dtype_size(dtype) == torch.empty((), dtype=dtype).element_size()
        assert dtype_names.dtype_name(dtype) == dtype_names.dtype_name(name) == name
    with pytest.raises(ValueError, match="int4"):
        dtype_size("int4")


OPTION_CASES = [{}, {"dtype": "bf16"}, {"kv_cache_dtype": "fp8"}, {"mamba_ssm_cache_dtype": "float32"},
                {"dtype": "float16", "mamba_cache_dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"},
                {"cache_memory": "300MiB", "block_size": 8, "max_model_len": 100, "enforce_eager": True},
                {"enable_prefix_caching": False, "prefix_snapshot_interval": 0, "cpu_kernels": False}]


@pytest.mark.parametrize("options", OPTION_CASES)
@pytest.mark.parametrize("family", ["bamba", "nemotron_h"])  # nemotron_h declares an SSM state dtype
def test_plan_config_plans_as_engine_config(tmp_path, family, options):
    path = _write(tmp_path / family, _case(family))
    hf_config = AutoConfig.from_pretrained(path)
    engine, plan = EngineConfig(device="cpu", **options), PlanConfig(device="cpu", **options)
    assert plan.resolve_dtypes(hf_config).as_names() == engine.resolve_dtypes(hf_config).as_names()
    by_engine, by_plan = plan_cache(hf_config, engine), plan_cache(load_config(path), plan)
    assert by_plan.to_dict() == by_engine.to_dict()


@pytest.mark.parametrize("bad", [{"dtype": "int4"}, {"block_size": 65}, {"block_size": True}, {"max_model_len": 0},
                                 {"cache_memory": "lots"}, {"cache_memory": -1}, {"prefix_snapshot_interval": -1},
                                 {"cpu_kernels": "yes"}, {"device": "tpu"}])
def test_plan_config_refuses_what_engine_config_refuses(bad):
    with pytest.raises(ValueError) as engine_error:
        EngineConfig(**bad)
    with pytest.raises(ValueError) as plan_error:
        PlanConfig(**bad)
    assert str(plan_error.value) == str(engine_error.value)


def test_sizes_and_default_length_match_the_engine():
    from hybridserve.engine import worker

    assert engine_parse_size is parse_size  # one parser, shared by the engine and the torch-free planner
    assert parse_size("1GiB") == 2 ** 30 and parse_size("512MB") == 512 * 10 ** 6 and parse_size(" 7 KiB ") == 7 * 1024
    for bad in ("0", "lots", "1e9", True):
        with pytest.raises(ValueError, match="cache_memory="):
            parse_size(bad)
    assert DEFAULT_MAX_MODEL_LEN == worker.DEFAULT_MAX_MODEL_LEN


# ------------------------------------------------------------------------------------------- the command
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_table_has_one_row_per_kind_of_layer(capsys):
    assert main(["plan", default_model_path()]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "\u00d7" in line and "│" in line]
    assert len(rows) == 2, out  # 4 Mamba2 layers, 2 attention layers: one row each
    mamba, attention = rows
    assert "\u00d74" in mamba and "mamba2" in mamba and "0-1, 3-4" in mamba
    assert "\u00d72" in attention and "attention" in attention and "2, 5" in attention


def test_json_keeps_every_layer_and_adds_the_groups(capsys):
    assert main(["plan", default_model_path(), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layers, groups = plan["layers"], plan["layer_groups"]
    assert [e["index"] for e in layers] == list(range(6))
    assert sum(g["count"] for g in groups) == len(layers) and len(groups) == 2
    by_index = {e["index"]: e for e in layers}
    for group in groups:
        assert group["count"] == len(group["layers"])
        for i in group["layers"]:
            assert (by_index[i]["kind"], by_index[i]["tensors"]) == (group["kind"], group["tensors"])


def test_model_type_stands_in_for_architectures(tmp_path, capsys):
    values = _case("bamba")
    del values["architectures"]
    path = _write(tmp_path / "no-arch", values)
    assert main(["plan", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "BambaForCausalLM"
    path = _write(tmp_path / "unknown", {"model_type": "gpt2", "n_layer": 2})
    assert main(["plan", path]) == 2
    err = capsys.readouterr().err
    assert "model_type='gpt2'" in err and "bamba" in err and "nemotron_h" in err  # names the allowed ones
    path = _write(tmp_path / "nothing", {"hidden_size": 8})
    assert main(["plan", path]) == 2
    assert "model_type" in capsys.readouterr().err


def test_max_model_len_past_the_trained_positions_warns(capsys):
    assert main(["plan", default_model_path(), "--max-model-len", "3000"]) == 0  # shipped model: 2048 positions
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3000" in err[0] and "2048" in err[0] and "max_position_embeddings" in err[0]
    assert main(["plan", default_model_path(), "--max-model-len", "2048"]) == 0
    assert capsys.readouterr().err == ""
