"""Kimi Linear beyond the shared family tables: MLA's latent cache (its bytes through ``hybridserve plan --json``,
its pages in the pool), prefix caching on and off, forks, an fp8 latent, and the published checkpoint layout's
conversion. The KDA ops are tested in tests/ops/test_kda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.engine.test_parity import NEW_TOKENS, prompts
from tests.hf_reference import compare, hf_greedy
from tests.prefix_utils import assert_drained, released_everything

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _plan(config_dir: str, *options: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "hybridserve.entrypoints.cli", "plan", config_dir, "--json", *options],
                          capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    return json.loads(done.stdout)


def test_mla_bytes_per_token_exact_in_plan(tmp_path):
    """``hybridserve plan --json`` on KimiLinearConfig's defaults (27 layers, MLA at 4, 8, ..., 24): KV bytes per
    token are layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, one ``latent`` tensor per MLA layer (no K,
    no V), and fp8 halves bf16."""
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(dtype="bfloat16")
    config.architectures = ["KimiLinearForCausalLM"]
    config.save_pretrained(str(tmp_path))
    mla_layers = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert mla_layers == [4, 8, 12, 16, 20, 24]
    latent = config.kv_lora_rank + config.qk_rope_head_dim  # 512 + 64
    bf16, fp8 = _plan(str(tmp_path)), _plan(str(tmp_path), "--kv-cache-dtype", "fp8_e4m3")
    assert bf16["kv_bytes_per_token"] == len(mla_layers) * latent * 2 == 6912
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
    assert bf16["page_bytes"] == 16 * bf16["kv_bytes_per_token"]  # 16-token pages, no padding
    for layer in bf16["layers"]:
        names = [(t["name"], t["per"], t["shape"]) for t in layer["tensors"]]
        if layer["index"] in mla_layers:
            assert layer["kind"] == "mla" and names == [("latent", "token", [1, latent])]
            assert layer["kv_bytes_per_token"] == latent * 2
        else:
            assert layer["kind"] == "kda"
            assert names == [("conv", "sequence", [3 * 32 * 128, 3]), ("recurrent", "sequence", [32, 128, 128])]


def test_latent_pages_in_the_pool(ckpt_dir):
    """The engine's layout and pool: MLA layers hold one latent view of 16-token pages (k and v unset); the model's
    specs follow kv_cache_dtype for the latent, mamba_cache_dtype for conv and mamba_ssm_cache_dtype for the state."""
    llm = LLM(make(ckpt_dir, "kimi_linear"), cache_memory="16MiB", kv_cache_dtype="bfloat16",
              mamba_cache_dtype="float16", mamba_ssm_cache_dtype="float32")
    layout = llm.cache_layout()
    config = llm.engine.hf_config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    mla = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert layout["block_size"] == 16 and layout["kv_bytes_per_token"] == len(mla) * latent * 2
    for entry in layout["layers"]:
        cache = llm.engine.pool.layer_caches[entry["index"]]
        if entry["kind"] == "mla":
            assert cache.k is None and cache.v is None
            assert entry["index"] in mla
            assert tuple(cache.latent.shape[1:]) == (16, 1, latent) and cache.latent.dtype == torch.bfloat16
        else:
            assert cache.latent is None
            assert cache.state["conv"].dtype == torch.float16 and cache.state["recurrent"].dtype == torch.float32


def test_prefix_caching_on_and_off_give_the_same_tokens(ckpt_dir):
    """Prompts sharing 40 tokens, one by one with prefix caching (the default) and all at once without: the same
    tokens and logprobs, and the later requests resume from the cached latent pages and KDA snapshot."""
    import random

    path = make(ckpt_dir, "kimi_linear")
    opts = {"cache_memory": "8MiB", "enable_progress_bar": False, "max_num_batched_tokens": 64}
    off, on = LLM(path, enable_prefix_caching=False, **opts), LLM(path, **opts)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 120) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 120) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    want = off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = [on.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert sorted(ea) == sorted(eb)
            for tid in ea:
                assert ea[tid].logprob == pytest.approx(eb[tid].logprob, abs=1e-4)
    assert got[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 40 for o in got[2:]), [o.num_cached_tokens for o in got]
    assert_drained(on.engine)


def test_forked_samples_continue_from_the_shared_latent(ckpt_dir):
    """``n=3`` greedy samples fork one prefill (latent pages and KDA state copied): each equals the single run."""
    llm = LLM(make(ckpt_dir, "kimi_linear"), cache_memory="16MiB", enable_progress_bar=False)
    prompt = {"prompt_token_ids": list(range(5, 40))}
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    forked = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3))[0]
    assert len(forked.outputs) == 3
    assert all(o.token_ids == single.outputs[0].token_ids for o in forked.outputs)
    assert released_everything(llm.engine)


def test_fp8_latent_halves_the_pages_and_follows_hf(ckpt_dir):
    """An fp8 (e4m3) latent cache: half the bf16 page bytes, fp8 views in the pool, and greedy decoding of the parity
    prompts that follows HF float32 up to near-ties (``compare`` raises on any other divergence). e4m3 keeps 3
    mantissa bits: the chosen tokens' logprobs move ~4e-2 on this tiny model (a bf16 latent: ~2e-3), far below the
    jumps of a wrong scale or a misplaced latent."""
    path = make(ckpt_dir, "kimi_linear")
    opts = dict(cache_memory="16MiB", enable_progress_bar=False, max_num_batched_tokens=20, max_num_seqs=3)
    bf16 = LLM(path, kv_cache_dtype="bfloat16", **opts)
    fp8 = LLM(path, kv_cache_dtype="fp8_e4m3", **opts)
    assert fp8.cache_layout()["kv_bytes_per_token"] * 2 == bf16.cache_layout()["kv_bytes_per_token"]
    mla = [e["index"] for e in fp8.cache_layout()["layers"] if e["kind"] == "mla"]
    assert mla and all(fp8.engine.pool.layer_caches[i].latent.dtype == torch.float8_e4m3fn for i in mla)
    ps = prompts(fp8.engine.hf_config.vocab_size)
    outs = fp8.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                  hf_greedy(path, ps, NEW_TOKENS))
    assert cmp.compared_tokens >= len(ps) * NEW_TOKENS // 2, cmp.diverged_at
    assert cmp.mean_abs_error <= 0.1, cmp.mean_abs_error
    assert released_everything(fp8.engine)


def test_missing_conv_weight_is_named(tmp_path, ckpt_dir):
    """The published layout's separate q/k/v convs are concatenated on load; one missing is an error naming it."""
    from safetensors.torch import load_file, save_file

    src = make(ckpt_dir, "kimi_linear")
    path = tmp_path / "broken"
    path.mkdir()
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            (path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    assert "model.layers.2.self_attn.k_conv1d.weight" in tensors  # HF's save writes the published layout
    del tensors["model.layers.2.self_attn.k_conv1d.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.k_conv1d\.weight"):
        LLM(str(path), cache_memory="16MiB")


def test_published_config_form_plans_as_the_model(tmp_path):
    """A config.json in the published checkpoints' form (``linear_attn_config`` with 1-indexed layer lists, no
    ``layer_types``): ``hybridserve plan`` decodes its layer kinds as the model built from it does."""
    from transformers import AutoConfig

    from hybridserve.cache.spec import CacheDtypes
    from hybridserve.models.kimi_linear import KimiLinearForCausalLM
    from hybridserve.planning.plan_config import PlanConfig
    from hybridserve.planning.planner import cache_specs_from_config, load_config

    values = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "num_hidden_layers": 5,
              "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_local_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 32, "vocab_size": 64,
              "linear_attn_config": {"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "head_dim": 16,
                                     "num_heads": 2, "short_conv_kernel_size": 3}}
    (tmp_path / "config.json").write_text(json.dumps(values))
    hf_config = load_config(str(tmp_path))
    options = PlanConfig(device="cpu", kv_cache_dtype="bfloat16", mamba_cache_dtype="float16",
                         mamba_ssm_cache_dtype="float32")
    planned = cache_specs_from_config(hf_config, options.resolve_dtypes(hf_config))
    assert [s.kind for s in planned] == ["kda", "mla", "kda", "kda", "mla"]
    torch_dtypes = CacheDtypes(kv=torch.bfloat16, conv=torch.float16, temporal=torch.float32)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(AutoConfig.from_pretrained(str(tmp_path)), torch_dtypes)
    assert [s.describe() for s in planned] == [s.describe() for s in model.cache_specs()]
    assert planned[0].describe()["tensors"][0]["shape"] == [3 * 2 * 16, 2]  # the short conv's 3 taps
