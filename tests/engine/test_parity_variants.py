"""Core architectures in other shapes than test_parity's: head/group counts, chunk and conv sizes."""

import pytest

from hybridserve import LLM, SamplingParams
from tests.checkpoints import make
from tests.engine.test_parity import prompts
from tests.hf_reference import compare, hf_greedy
from tests.prefix_utils import released_everything

VARIANTS = {
    "bamba-g1-chunk8-conv3": ("bamba", dict(mamba_n_groups=1, mamba_chunk_size=8, mamba_d_conv=3,
                                            num_key_value_heads=1, attn_layer_indices=[0, 3])),
    "bamba-g4-d32": ("bamba", dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=4, mamba_d_state=8,
                                   mamba_chunk_size=32, num_attention_heads=2, num_key_value_heads=2)),
    "mamba2-g1-chunk5": ("mamba2", dict(n_groups=1, chunk_size=5, conv_kernel=2, num_heads=4, head_dim=32)),
    # the gated RMS norm applied before the gate (``norm(y) * silu(z)``), one SSM group
    "falcon_h1-norm-before-gate": ("falcon_h1", dict(mamba_norm_before_gate=True, mamba_n_groups=1)),
    "llama-mha-hd32": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32)),
    # LFM3 without sandwich norms and output gates, MHA, biased attention, a 5-token window (the block size
    # here is 8: windows and blocks misaligned), plain RoPE on the full layers too
    "lfm3-nosandwich-nogate-w5": ("lfm3", dict(use_sandwich_norm=False, use_attention_gate=False, attention_bias=True,
                                               num_key_value_heads=4, sliding_window=5,
                                               rope_parameters={"full_attention": {"rope_type": "default",
                                                                                   "rope_theta": 1e4},
                                                                "sliding_attention": {"rope_type": "default",
                                                                                      "rope_theta": 1e4}})),
    "lfm2-moe-nobias-top3": ("lfm2_moe", dict(use_expert_bias=False, norm_topk_prob=False, num_experts_per_tok=3,
                                              num_dense_layers=2, routed_scaling_factor=1.5, num_key_value_heads=1)),
    # one value head per key head, wider key than value heads, a 3-tap conv, RoPE over half of each head
    "qwen3_5-r1-conv3": ("qwen3_5", dict(linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=24,
                                         linear_conv_kernel_dim=3, num_key_value_heads=1,
                                         rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                          "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
                                                          "mrope_interleaved": True})),
    "qwen3_5_moe-top3-r4": ("qwen3_5_moe", dict(num_experts_per_tok=3, linear_num_key_heads=1, linear_num_value_heads=4,
                                                layer_types=["linear_attention", "linear_attention", "full_attention",
                                                             "linear_attention"])),
    # NoPE (the released checkpoints'), beta in [0, 1], one KV head, a 3-tap conv, wider key than value heads
    "olmo_hybrid-nope-posbeta-conv3": ("olmo_hybrid", dict(rope_parameters={"rope_type": "default", "rope_theta": None},
                                                           linear_allow_neg_eigval=False, num_key_value_heads=1,
                                                           linear_conv_kernel_dim=3, linear_num_key_heads=2,
                                                           linear_num_value_heads=2, linear_key_head_dim=32,
                                                           linear_value_head_dim=24)),
    # two value heads per key head (value head h reads key head h // 2, HF's repeat_interleave), 3 key heads
    "olmo_hybrid-grouped-values": ("olmo_hybrid", dict(linear_num_key_heads=3, linear_num_value_heads=6,
                                                       linear_key_head_dim=16, linear_value_head_dim=16)),
    # biases everywhere (norms included), HF's default gate cap (15), a tight logit cap, 2 heads of 64, chunks of
    # 8 (HF cannot build weight_mode "fused" from a config: tests/models/test_xlstm.py checks it against these weights)
    "xlstm-bias-caps": ("xlstm", dict(use_bias=True, gate_soft_cap=15.0, output_logit_soft_cap=4.0, num_heads=2,
                                      qk_dim_factor=1.0, chunk_size=8)),
    # single projections, wider values than keys per head (qk 8, v 48), a 96-multiple feed-forward
    "xlstm-qk-narrow": ("xlstm", dict(num_heads=8, qk_dim_factor=0.5, v_dim_factor=3.0, ffn_proj_factor=1.3,
                                      ffn_round_up_to_multiple_of=96)),
    # a plain q_proj (no q_lora_rank), one expert group, top-3, a 3-tap conv, 2 KDA heads of 32, MLA first
    "kimi_linear-qproj-g1-conv3": ("kimi_linear", dict(q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=3,
                                                       linear_conv_kernel_dim=3, linear_num_heads=2, linear_head_dim=32,
                                                       layer_types=["full_attention", "linear_attention",
                                                                    "linear_attention", "full_attention"])),
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


@pytest.mark.parametrize("family", ["lfm2_moe", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear"])
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
