"""Core architectures in other shapes than test_parity's: head/group counts, chunk and conv sizes."""

import pytest

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.hf_reference import compare, hf_greedy
from tests.prefix_utils import released_everything
from tests.test_parity import prompts

VARIANTS = {
    "bamba-g1-chunk8-conv3": ("bamba", dict(mamba_n_groups=1, mamba_chunk_size=8, mamba_d_conv=3,
                                            num_key_value_heads=1, attn_layer_indices=[0, 3])),
    "bamba-g4-d32": ("bamba", dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=4, mamba_d_state=8,
                                   mamba_chunk_size=32, num_attention_heads=2, num_key_value_heads=2)),
    "mamba2-g1-chunk5": ("mamba2", dict(n_groups=1, chunk_size=5, conv_kernel=2, num_heads=4, head_dim=32)),
    "llama-mha-hd32": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32)),
    "lfm2-moe-nobias-top3": ("lfm2_moe", dict(use_expert_bias=False, norm_topk_prob=False, num_experts_per_tok=3,
                                              num_dense_layers=2, routed_scaling_factor=1.5, num_key_value_heads=1)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_hf(ckpt_dir, variant):
    family, overrides = VARIANTS[variant]
    path = make(ckpt_dir, family, seed=7, **overrides)
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=4, cache_memory="16MiB", block_size=8)
    ps = prompts(llm.engine.hf_config.vocab_size, seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True))
    refs = hf_greedy(path, ps, 10)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= len(ps) * 5, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3
    assert released_everything(llm.engine)


@pytest.mark.parametrize("family", ["lfm2_moe"])
def test_preempted_requests_match_hf(ckpt_dir, family):
    """A pool that holds about two of the six requests: they are preempted and recomputed, and every one still
    matches HF."""
    path = make(ckpt_dir, family)
    probe = LLM(path, cache_memory="16MiB", block_size=8)
    layout = probe.cache_layout()
    tight = layout["slot_bytes"] + 12 * layout["page_bytes"]
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=6, cache_memory=2 * tight + 64, block_size=8)
    ps = prompts(llm.engine.hf_config.vocab_size, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    refs = hf_greedy(path, ps, 10)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= len(ps) * 5, cmp.diverged_at
    assert cmp.max_topk_error <= 1e-3
    assert released_everything(llm.engine)
