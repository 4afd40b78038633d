"""OLMo-Hybrid beyond the shared family tables: RoPE or NoPE as HF decides it, the checkpoint's two layouts
(OLMo-core's norm names and split conv weight, or HF's module names) loading alike, and clear errors for what
the family cannot serve."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from hybridserve.cache.spec import CacheDtypes
from hybridserve.models.olmo_hybrid import NoRotary, OlmoHybridForCausalLM
from tests.checkpoints import make, olmo_hybrid_config
from tests.engine.test_parity import prompts

DTYPES = CacheDtypes(kv=torch.float32, conv=torch.float32, temporal=torch.float32)
NOPE = {"rope_parameters": {"rope_type": "default", "rope_theta": None}}


def _meta_model(config) -> OlmoHybridForCausalLM:
    with torch.device("meta"):
        return OlmoHybridForCausalLM(config, DTYPES)


@pytest.mark.parametrize("overrides, rope", [({}, True), (NOPE, False)])
def test_rope_or_nope_as_hf_decides(ckpt_dir, overrides, rope):
    """The saved config, read back, gives HF's model a rotary embedding exactly when it gives ours one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(make(ckpt_dir, "olmo_hybrid", **overrides))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    assert (hf.model.rotary_emb is not None) == rope
    assert isinstance(_meta_model(config).model.rotary_emb, NoRotary) != rope


def _generate(path: str) -> list:
    llm = LLM(path, max_num_batched_tokens=20, max_num_seqs=3, cache_memory="16MiB", enable_progress_bar=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(128)[:3]],
                        SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _rewrite(src: str, dst: str, edit) -> str:
    """A copy of checkpoint ``src`` at ``dst`` with its tensors passed through ``edit``."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    save_file(edit(load_file(os.path.join(src, "model.safetensors"))), os.path.join(dst, "model.safetensors"))
    return dst


def _hf_module_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's module names: norms renamed, each layer's conv weight joined from its q, k, v parts."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("q_conv1d.weight"):
            prefix = name.removesuffix("q_conv1d.weight")
            out[prefix + "conv1d.weight"] = torch.cat([t, tensors[prefix + "k_conv1d.weight"],
                                                       tensors[prefix + "v_conv1d.weight"]])
        elif not name.endswith(("k_conv1d.weight", "v_conv1d.weight")):
            name = name.replace(".attention_layer_norm.", ".input_layernorm.")
            out[name.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")] = t
    return out


def test_hf_module_names_load_the_same(ckpt_dir, tmp_path):
    """A checkpoint under HF's module names (joined conv weight, HF's norm names) serves the same tokens and
    logprobs, bit for bit, as the one ``save_pretrained`` writes (OLMo-core's names, conv in three parts)."""
    path = make(ckpt_dir, "olmo_hybrid")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert "model.layers.0.linear_attn.q_conv1d.weight" in tensors  # the layout HF saves
    assert "model.layers.0.attention_layer_norm.weight" in tensors
    renamed = _rewrite(path, str(tmp_path / "hf-names"), _hf_module_names)
    assert _generate(renamed) == _generate(path)


def test_missing_conv_part_is_named(ckpt_dir, tmp_path):
    path = make(ckpt_dir, "olmo_hybrid")
    broken = _rewrite(path, str(tmp_path / "no-k-conv"),
                      lambda t: {n: v for n, v in t.items() if n != "model.layers.2.linear_attn.k_conv1d.weight"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.linear_attn\.k_conv1d\.weight"):
        LLM(broken, cache_memory="16MiB")


def test_value_heads_not_a_multiple_of_key_heads_are_rejected():
    """Value heads are grouped per key head (HF's ``repeat_interleave``): a count that does not divide is refused
    by name."""
    config = olmo_hybrid_config(linear_num_key_heads=2, linear_num_value_heads=3)
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a multiple of "
                                         r"linear_num_key_heads \(2\)"):
        _meta_model(config)


def test_unknown_layer_type_is_named():
    config = olmo_hybrid_config()
    config.layer_types = ["linear_attention", "mamba", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer 1 has type 'mamba'.*supported: linear_attention, full_attention"):
        _meta_model(config)
