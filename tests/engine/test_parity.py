"""Every architecture against HF transformers in float32: greedy tokens and top-5 logprobs.

Prompts of mixed lengths (not multiples of the chunk or block size), a token budget small enough
to split prefills, and fewer running slots than prompts, so requests queue.
"""

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.default_configs import ATTENTION_PATTERNS, SIZES
from tests.hf_reference import compare, hf_greedy, hf_greedy_uncached
from tests.prefix_utils import released_everything

FAMILIES = ["llama", "mamba2", "bamba", "mamba", "falcon_mamba", "jamba", "granitemoehybrid", "nemotron_h", "minimax",
            "lfm2", "lfm2_moe", "lfm3", "qwen3_next", "zamba2", "falcon_h1", "qwen3_5", "qwen3_5_moe",
            "olmo_hybrid", "xlstm", "kimi_linear"]
PROMPT_LENGTHS = [1, 7, 19, 33, 50, 70]
NEW_TOKENS = 12


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_matches_hf(ckpt_dir, family):
    path = make(ckpt_dir, family)
    llm = LLM(path, max_num_batched_tokens=20, max_num_seqs=3, cache_memory="16MiB")
    ps = prompts(llm.engine.hf_config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
    refs = hf_greedy(path, ps, NEW_TOKENS)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= len(ps) * NEW_TOKENS // 2, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3, cmp.max_topk_error
    assert released_everything(llm.engine)


def test_granitemoehybrid_dense_matches_hf(ckpt_dir):
    """Granite-4.0-H's dense variant (no routed experts: the shared MLP only), without RoPE."""
    test_float32_matches_hf(ckpt_dir, "granitemoehybrid_dense")


def test_nemotron_h_latent_moe_matches_hf(ckpt_dir):
    """Nemotron-H with ``moe_latent_size``: routed experts between fc1/fc2 latent projections."""
    test_float32_matches_hf(ckpt_dir, "nemotron_h_latent")


@pytest.mark.parametrize("family", list(SIZES))
def test_float32_at_config_defaults_matches_hf(ckpt_dir, family):
    """Each family with every option of its config class at the transformers default (only sizes tiny,
    ``tests/default_configs.py``): the configuration a user gets who sets nothing."""
    test_float32_matches_hf(ckpt_dir, f"{family}_defaults")


@pytest.mark.parametrize("family", list(ATTENTION_PATTERNS))
def test_mamba2_only_class_pattern_matches_hf(ckpt_dir, family):
    """Granite-4.0-H and Bamba at their config class's own layer pattern (Mamba2 layers only, no attention),
    against HF's uncached forward (its ``generate`` cannot run such a model)."""
    path = make(ckpt_dir, f"{family}_defaults_mamba_only")
    llm = LLM(path, max_num_batched_tokens=20, max_num_seqs=3, cache_memory="16MiB")
    assert llm.cache_layout()["kv_bytes_per_token"] == 0  # no attention layer: the class's pattern
    ps = prompts(llm.engine.hf_config.vocab_size)[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True))
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                  hf_greedy_uncached(path, ps, 8))
    assert cmp.compared_tokens >= len(ps) * 4, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3, cmp.max_topk_error
    assert released_everything(llm.engine)
