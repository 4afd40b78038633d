"""Every bad input is a ValueError naming the value (and the allowed ones), and the engine still serves."""

import json
import os
import shutil

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig, parse_size
from tests.checkpoints import make
from tests.prefix_utils import released_everything


@pytest.mark.parametrize("option,value,needle", [
    ("dtype", "float64", "float32, bfloat16, float16"),
    ("kv_cache_dtype", "int8", "fp8_e4m3"),
    ("mamba_cache_dtype", "fp8_e4m3", "float32, bfloat16, float16, int8"),  # 8-bit conv state is int8 only: why
    ("mamba_cache_dtype", "fp8_e4m3", "an 8-bit conv state is int8"),
    ("mamba_cache_dtype", "int4", "auto, float32, bfloat16, float16, int8"),
    ("mamba_ssm_cache_dtype", "int4", "int8, fp8_e4m3"),
    ("mamba_ssm_cache_dtype", "float8", "float32, bfloat16, float16"),
    ("device", "tpu", "auto, cpu, cuda"),
    ("max_num_seqs", 0, "positive integer"),
    ("max_num_batched_tokens", -3, "positive integer"),
    ("max_model_len", "long", "positive integer"),
    ("cache_memory", "lots", "2GiB"),
    ("cache_memory", 0, "positive"),
    ("block_size", 128, "between 1 and 64"),
    ("seed", 1.5, "integer"),
])
def test_config_errors_name_value_and_allowed(option, value, needle):
    with pytest.raises(ValueError) as err:
        EngineConfig(model="x", **{option: value})
    assert option in str(err.value) and repr(value) in str(err.value) and needle in str(err.value)


def test_sizes_and_aliases():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MB") == 512 * 10**6 and parse_size(1024) == 1024
    cfg = EngineConfig(model="x", dtype="bf16", kv_cache_dtype="fp8", mamba_ssm_cache_dtype=torch.float32)
    assert (cfg.dtype, cfg.kv_cache_dtype, cfg.mamba_ssm_cache_dtype) == ("bfloat16", "fp8_e4m3", "float32")


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"max_tokens": -1}, "max_tokens"), ({"logprobs": 50}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 0}, "n="), ({"seed": "x"}, "seed"), ({"stop": ""}, "stop"),
    ({"seed": 2 ** 64}, r"seed=18446744073709551616 .*\[-9223372036854775808, 18446744073709551615\]"),
    ({"seed": 2 ** 64 - 2, "n": 4}, r"with n=4"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens=20 .*at most max_tokens=10"),
    # float32 rounds these to 0 or inf, and the logits to inf or NaN (a failed request, not a refused one)
    ({"repetition_penalty": 1e-300}, r"repetition_penalty=1e-300 .*\[0.01, 100\]"),
    ({"repetition_penalty": 1e300}, r"repetition_penalty=1e\+300 .*\[0.01, 100\]"),
    ({"temperature": 1e300}, r"temperature=1e\+300 .*\[0, 100\]"),
])
def test_sampling_param_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_dtype_resolution(ckpt_dir):
    path32 = make(ckpt_dir, "bamba")
    path16 = make(ckpt_dir, "bamba", dtype=torch.bfloat16)
    from transformers import AutoConfig

    c16 = AutoConfig.from_pretrained(path16)
    r = EngineConfig(model=path16).resolve_dtypes(c16)
    assert (r.model, r.kv_cache, r.conv_state, r.ssm_state) == (torch.bfloat16,) * 4
    r = EngineConfig(model=path16, mamba_cache_dtype="float16").resolve_dtypes(c16)
    assert r.conv_state == torch.float16 and r.ssm_state == torch.float16  # auto SSM follows conv
    c16.mamba_ssm_dtype = "float32"  # a checkpoint's own declaration wins over the conv dtype
    assert EngineConfig(model=path16).resolve_dtypes(c16).ssm_state == torch.float32
    c16.mamba_ssm_cache_dtype = "float16"
    assert EngineConfig(model=path16).resolve_dtypes(c16).ssm_state == torch.float16
    assert EngineConfig(model=path16, mamba_ssm_cache_dtype="bfloat16").resolve_dtypes(c16).ssm_state == torch.bfloat16
    c32 = AutoConfig.from_pretrained(path32)
    assert EngineConfig(model=path32).resolve_dtypes(c32).model == torch.float32
    a, b = EngineConfig(model=path32), EngineConfig(model=path32, mamba_ssm_cache_dtype="float16")
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == EngineConfig(model=path32).fingerprint()


def test_request_errors_leave_engine_serving(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    llm = LLM(path, cache_memory="4MiB", max_model_len=64)
    good = {"prompt_token_ids": [5, 6, 7]}
    bad_cases = [
        ({"prompt_token_ids": list(range(3, 63))}, SamplingParams(max_tokens=10), "max_model_len=64"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [5, 100000]}, SamplingParams(), "outside the vocabulary"),
        ("a string", SamplingParams(), "no tokenizer"),
        (42, SamplingParams(), "prompt must be"),
    ]
    for prompt, params, needle in bad_cases:
        with pytest.raises(ValueError, match=needle):
            llm.generate([good, prompt], params)
        assert released_everything(llm.engine) and not llm.engine.has_unfinished_requests()
        out = llm.generate([good], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) >= 1


def test_request_larger_than_pool_is_rejected(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    probe = LLM(path, cache_memory="4MiB").cache_layout()
    llm = LLM(path, cache_memory=probe["slot_bytes"] + 2 * probe["page_bytes"] + 64, max_model_len=512)
    with pytest.raises(ValueError, match="does not fit in cache_memory"):
        llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=10))
    assert llm.generate([{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=4))[0].finished


def test_loader_is_strict(ckpt_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = make(ckpt_dir, "bamba")

    def variant(name, mutate):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        weights = load_file(dst / "model.safetensors")
        mutate(weights)
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
        return str(dst)

    missing = variant("missing", lambda w: w.pop("model.layers.0.mamba.A_log"))
    with pytest.raises(ValueError, match="missing weights.*model.layers.0.mamba.A_log"):
        LLM(missing)
    extra = variant("extra", lambda w: w.__setitem__("model.layers.0.bogus", torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected weights.*model.layers.0.bogus"):
        LLM(extra)
    shaped = variant("shaped", lambda w: w.__setitem__("model.layers.0.mamba.D", torch.zeros(3)))
    with pytest.raises(ValueError, match="wrong shape.*model.layers.0.mamba.D"):
        LLM(shaped)
    arch = tmp_path / "arch"
    shutil.copytree(src, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported.*BambaForCausalLM"):
        LLM(str(arch))
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "nowhere"))


def test_sharded_and_tied_checkpoints(ckpt_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import bamba_config, build

    tied = build(bamba_config(tie_word_embeddings=True), str(tmp_path / "tied"))
    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(tied).save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    prompt = [{"prompt_token_ids": [5, 9, 17, 3]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(tied, cache_memory="4MiB").generate(prompt, params)[0].outputs[0].token_ids
    b = LLM(sharded, cache_memory="4MiB").generate(prompt, params)[0].outputs[0].token_ids
    ref = AutoModelForCausalLM.from_pretrained(tied)
    ref.generation_config.eos_token_id = None
    hf = ref.generate(torch.tensor([[5, 9, 17, 3]]), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
    assert a == b == hf


@pytest.mark.parametrize("value,dtype", [("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8", torch.float8_e4m3fn)])
def test_eight_bit_temporal_state_is_an_option(ckpt_dir, value, dtype):
    from transformers import AutoConfig

    from hybridserve.planning.plan_config import PlanConfig

    path = make(ckpt_dir, "bamba")
    config = EngineConfig(model=path, mamba_ssm_cache_dtype=value)
    resolved = config.resolve_dtypes(AutoConfig.from_pretrained(path))
    assert resolved.ssm_state == dtype and resolved.conv_state == torch.float32  # the conv state keeps its dtype
    assert resolved.as_names()["mamba_ssm_cache_dtype"] == config.mamba_ssm_cache_dtype
    assert config.fingerprint(resolved) != EngineConfig(model=path).fingerprint(
        EngineConfig(model=path).resolve_dtypes(AutoConfig.from_pretrained(path)))
    assert PlanConfig(mamba_ssm_cache_dtype=value).mamba_ssm_cache_dtype == config.mamba_ssm_cache_dtype
    if value == "int8":  # an 8-bit conv state is int8 (codes and a power-of-two exponent per channel)
        assert PlanConfig(mamba_cache_dtype=value).mamba_cache_dtype == "int8"
        conv = EngineConfig(model=path, mamba_cache_dtype=value).resolve_dtypes(AutoConfig.from_pretrained(path))
        assert conv.conv_state == torch.int8 and conv.ssm_state == torch.int8  # ssm "auto" follows the conv dtype
    else:
        with pytest.raises(ValueError, match="an 8-bit conv state is int8"):
            PlanConfig(mamba_cache_dtype=value)


def test_the_cli_refuses_fp8_conv_state_with_the_reason(capsys):
    from hybridserve.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--mamba-cache-dtype", "fp8_e4m3"])
    err = capsys.readouterr().err
    assert "--mamba-cache-dtype" in err and "an 8-bit conv state is int8" in err
    assert "--mamba-ssm-cache-dtype fp8_e4m3" in err
    with pytest.raises(SystemExit):
        main(["plan", "--mamba-cache-dtype", "float64"])
    assert "allowed values: auto, float32, bfloat16, float16, int8" in capsys.readouterr().err
