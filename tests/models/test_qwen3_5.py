"""Qwen3.5 beyond the shared family tables: its M-RoPE is plain RoPE for text, and its vision-language
checkpoints (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``) serve as text,
matching HF's ConditionalGeneration class in float32, with the vision tower never read."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from safetensors.torch import save_file

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.engine.test_parity import NEW_TOKENS, prompts
from tests.hf_reference import RefResult, compare
from tests.prefix_utils import released_everything

#: checkpoint family -> HF's class for it (not AutoModelForCausalLM: that maps these configs to the text model)
VL_CLASSES = {"qwen3_5_vl": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration"}


@pytest.mark.parametrize("head_dim, factor, section", [(256, 0.25, [11, 11, 10]),  # the published models'
                                                       (32, 0.25, [2, 1, 1]), (64, 0.5, [4, 2, 2])])  # the tests'
def test_text_mrope_is_plain_rope(head_dim, factor, section):
    """HF's interleaved M-RoPE, fed the text positions HF gives a text-only prompt (the three streams equal),
    against our RoPE, bit for bit."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from hybridserve.layers.rotary import RotaryEmbedding

    config = Qwen3_5TextConfig(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": factor, "mrope_section": section,
        "mrope_interleaved": True})
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 70000])
    hf_cos, hf_sin = Qwen3_5TextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32),
                                                        positions.view(1, 1, -1).expand(3, 1, -1))
    cos, sin = RotaryEmbedding(config, head_dim)(positions, torch.float32)  # (T, rotary_dim)
    assert cos.shape == (len(positions), int(head_dim * factor))
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


@functools.lru_cache(maxsize=4)
def _hf_model(path: str, class_name: str):
    import transformers

    return getattr(transformers, class_name).from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_conditional_greedy(path: str, class_name: str, ps: list[list[int]], max_new_tokens: int) -> list[RefResult]:
    """``tests.hf_reference.hf_greedy`` through HF's vision-language class, text-only input."""
    model = _hf_model(path, class_name)
    model.generation_config.eos_token_id = None  # pure argmax of raw logits: never stop
    results = []
    for ids in ps:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        results.append(RefResult(out.sequences[0, len(ids):].tolist(),
                                 [torch.log_softmax(step[0].float(), -1) for step in out.logits]))
    return results


@pytest.mark.parametrize("family, overrides", [("qwen3_5_vl", {}), ("qwen3_5_moe_vl", {}),
                                               ("qwen3_5_vl", {"tie_word_embeddings": True})])
def test_conditional_generation_matches_hf(ckpt_dir, family, overrides):
    """Mixed prompt lengths, split prefills and queued requests, against HF's ConditionalGeneration class."""
    path = make(ckpt_dir, family, **overrides)
    llm = LLM(path, max_num_batched_tokens=20, max_num_seqs=3, cache_memory="16MiB")
    config = llm.engine.hf_config  # the served config: the checkpoint's text_config
    assert config.architectures == [VL_CLASSES[family]] and config.model_type.endswith("_text")
    assert config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    # tied: the checkpoint has no lm_head (HF drops it), so it loaded only because the embeddings were shared
    assert ("lm_head.weight" in _checkpoint_keys(path)) != config.tie_word_embeddings
    ps = prompts(config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
    refs = hf_conditional_greedy(path, VL_CLASSES[family], ps, NEW_TOKENS)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= len(ps) * NEW_TOKENS // 2, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3, cmp.max_topk_error
    assert released_everything(llm.engine)


def test_preempted_conditional_generation_matches_hf(ckpt_dir):
    """A pool that holds about two of the six requests: they are preempted and recomputed, and every one still
    matches HF's ConditionalGeneration class."""
    path = make(ckpt_dir, "qwen3_5_moe_vl")
    layout = LLM(path, cache_memory="16MiB", block_size=8).cache_layout()
    tight = layout["slot_bytes"] + 12 * layout["page_bytes"]
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=6, cache_memory=2 * tight + 64, block_size=8)
    ps = prompts(llm.engine.hf_config.vocab_size, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    refs = hf_conditional_greedy(path, VL_CLASSES["qwen3_5_moe_vl"], ps, 10)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= len(ps) * 5, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3, cmp.max_topk_error
    assert released_everything(llm.engine)


def test_vision_tower_and_mtp_head_are_never_read(tmp_path, ckpt_dir, monkeypatch):
    """Every ``model.visual.*`` and ``mtp.*`` tensor is skipped by name, never read; the language model's all are."""
    import shutil

    from hybridserve.models import weight_checks

    path = str(tmp_path / "vl")
    shutil.copytree(make(ckpt_dir, "qwen3_5_vl"), path)
    save_file({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64)},
              os.path.join(path, "mtp.safetensors"))  # a multi-token-prediction head beside the model
    read: list[str] = []
    real_open = weight_checks.safe_open  # the loader reads every weights file through weight_checks

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(weight_checks, "safe_open", Recording)
    llm = LLM(path, cache_memory="16MiB")
    visual = [n for n in _checkpoint_keys(path) if n.startswith("model.visual.")]
    assert visual and not any(n.startswith(("model.visual.", "mtp.")) for n in read), read
    language = [n for n in _checkpoint_keys(path) if n.startswith(("model.language_model.", "lm_head."))]
    assert sorted(read) == sorted(language)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def _checkpoint_keys(path: str) -> list[str]:
    from safetensors import safe_open

    keys = []
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                keys += list(f.keys())
    return keys


def test_bf16_checkpoint_dtype_comes_from_the_top_level_config(ckpt_dir):
    """A bf16 vision-language checkpoint records its dtype at the top level only: the served model is bf16."""
    path = make(ckpt_dir, "qwen3_5_moe_vl", dtype=torch.bfloat16)
    layout = LLM(path, cache_memory="16MiB", mamba_ssm_cache_dtype="float32").cache_layout()
    assert layout["dtype"] == "bfloat16" and layout["mamba_ssm_cache_dtype"] == "float32"
    assert layout["mamba_cache_dtype"] == "bfloat16"


def test_missing_projection_is_named(tmp_path, ckpt_dir):
    """A checkpoint without one of the separate gated-delta-net projections: an error naming it."""
    from safetensors.torch import load_file

    src = make(ckpt_dir, "qwen3_5")
    path = tmp_path / "broken"
    path.mkdir()
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            (path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.2.linear_attn.in_proj_z.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.linear_attn\.in_proj_z\.weight"):
        LLM(str(path), cache_memory="16MiB")
