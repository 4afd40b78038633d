"""LFM3 beyond the shared family tables: its per-layer-type RoPE against HF's bit for bit, the layer mixes
that change its page groups, a tied LM head, and clear errors for what it does not take."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.spec import CacheDtypes
from hybridserve.models.lfm3 import Lfm3ForCausalLM, Lfm3RotaryEmbedding
from tests.checkpoints import lfm3_config, make
from tests.engine.test_parity import NEW_TOKENS, prompts
from tests.hf_reference import compare, hf_greedy
from tests.prefix_utils import released_everything

DTYPES = CacheDtypes(kv=torch.float32, conv=torch.float32, temporal=torch.float32)


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_rope_of_each_layer_type_is_hfs(head_dim, layer_type):
    """Default RoPE (sliding layers) and proportional RoPE over half the pairs (full layers), float32."""
    from transformers.models.lfm3.modeling_lfm3 import Lfm3RotaryEmbedding as HfRotary

    config = lfm3_config(head_dim=head_dim)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 70000])
    hf_cos, hf_sin = HfRotary(config)(torch.zeros(1), positions.view(1, -1), layer_type)
    cos, sin = Lfm3RotaryEmbedding(config, head_dim, layer_type)(positions, torch.float32)  # (T, head_dim)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    if layer_type == "full_attention":  # the second half of the pairs is not rotated
        assert torch.equal(cos[:, head_dim // 4:head_dim // 2], torch.ones(len(positions), head_dim // 4))


def test_specs_window_only_the_sliding_layers():
    config = lfm3_config()
    with torch.device("meta"):
        model = Lfm3ForCausalLM(config, DTYPES)
    specs = {s.index: s for s in model.cache_specs()}
    for i, kind in enumerate(config.layer_types):
        spec = specs[i]
        if kind == "conv":
            assert spec.attention is None and [t.name for t in spec.state] == ["conv"]
        else:
            assert spec.attention.sliding_window == (8 if kind == "sliding_attention" else None)


# layer mixes: no sliding layer (one page group, no window); sliding layers only (one group: nothing to keep
# whole beside them, so their pages are never released); the default mix with a tied LM head
MIXES = {
    "no-sliding": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_hidden_layers=4),
    "sliding-only": dict(layer_types=["conv", "sliding_attention", "conv", "sliding_attention"], num_hidden_layers=4),
    "tied": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_layer_mixes_match_hf(ckpt_dir, mix):
    path = make(ckpt_dir, "lfm3", **MIXES[mix])
    llm = LLM(path, max_num_batched_tokens=20, max_num_seqs=3, cache_memory="16MiB", enable_progress_bar=False)
    layout = llm.engine.pool.layout
    assert layout.window == (8 if mix == "tied" else None)
    ps = prompts(llm.engine.hf_config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
    refs = hf_greedy(path, ps, NEW_TOKENS)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= len(ps) * NEW_TOKENS // 2, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3, cmp.max_topk_error
    assert released_everything(llm.engine)


def test_checkpoint_gate_name_is_mapped(ckpt_dir):
    """Checkpoints store the per-head gate as ``self_attn.gate_proj`` (HF renames it on load)."""
    from safetensors import safe_open

    path = make(ckpt_dir, "lfm3")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.self_attn.gate_proj.weight" in names
    llm = LLM(path, cache_memory="4MiB", cpu_kernels=False, enable_progress_bar=False)  # nn.Linear kept as is
    gate = llm.engine.model.model.layers[1].self_attn.g_proj.weight
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert torch.equal(gate, f.get_tensor("model.layers.1.self_attn.gate_proj.weight"))


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["conv", "linear_attention", "full_attention", "conv", "conv", "conv"]),
     "layer 1: layer_types entry 'linear_attention' is not supported; supported: conv, full_attention"),
    (dict(sliding_window=None), "sliding_window=None: sliding_attention layers need a positive window"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters['full_attention']: rope_type='yarn' is not supported; supported: default, proportional"),
])
def test_unsupported_configs_are_clear_errors(overrides, message):
    config = lfm3_config()
    for key, value in overrides.items():  # set after construction: the config class validates some of these
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Lfm3ForCausalLM(config, DTYPES)
