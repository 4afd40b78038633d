"""Tiny random checkpoints built with transformers' own config classes, saved with save_pretrained."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

import torch

from tests.default_configs import DEFAULTS_BUILDERS

LM_HEAD_SCALE = 4.0


def _peaky(model: Any, scale: float, std: float) -> None:
    """Larger init so logits are peaky and greedy decoding is stable on a random model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
        if getattr(model.config, "tie_word_embeddings", False):
            for name, p in model.named_parameters():
                final = "final" in name or name.endswith("model.norm.weight") or "norm_f" in name
                if "norm" in name and name.endswith("weight") and final:
                    p.mul_(scale)
        else:
            model.lm_head.weight.mul_(scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init; give routing a real correction
                b.normal_(0.0, 0.1)


def save_checkpoint(model: Any, path: str, dtype: torch.dtype = torch.float32) -> str:
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(path)
    return path


def build(config: Any, path: str, seed: int = 0, std: float = 0.08, dtype: torch.dtype = torch.float32) -> str:
    """Instantiate ``config``'s causal LM with random weights and save it to ``path``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    # a vision-language config (Qwen3.5's ConditionalGeneration) builds its image-text-to-text class
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    _peaky(model, LM_HEAD_SCALE, std)
    return save_checkpoint(model, path, dtype)


def bamba_config(**overrides: Any) -> Any:
    from transformers import BambaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
              mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=2048, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return BambaConfig(**kw)


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return LlamaConfig(**kw)


def mamba2_config(**overrides: Any) -> Any:
    from transformers import Mamba2Config

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16,
              n_groups=2, conv_kernel=4, expand=2, chunk_size=16, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return Mamba2Config(**kw)


def granitemoehybrid_config(**overrides: Any) -> Any:
    """Granite-4.0-H, MoE variant: Mamba2 + attention (RoPE), routed experts plus the shared MLP,
    every multiplier away from 1."""
    from transformers import GraniteMoeHybridConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
              num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
              mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
              embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.7, logits_scaling=1.25,
              max_position_embeddings=2048, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return GraniteMoeHybridConfig(**kw)


def granitemoehybrid_dense_config(**overrides: Any) -> Any:
    """Granite-4.0-H, dense variant (``num_local_experts=0``: the shared MLP only) without RoPE (NoPE)."""
    kw = dict(num_local_experts=0, position_embedding_type=None, shared_intermediate_size=96,
              layer_types=["mamba", "mamba", "attention", "mamba"])
    kw.update(overrides)
    return granitemoehybrid_config(**kw)


def nemotron_h_config(**overrides: Any) -> Any:
    """Nemotron-H: Mamba2, attention (no RoPE), relu^2 MLP and MoE layers ("M*E-ME"); grouped
    sigmoid routing with a correction bias (randomized in ``_peaky``) and a shared expert."""
    from transformers import NemotronHConfig

    kw = dict(vocab_size=128, hidden_size=64, hybrid_override_pattern="M*E-ME",
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
              mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, norm_topk_prob=True,
              routed_scaling_factor=1.5, max_position_embeddings=2048, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return NemotronHConfig(**kw)


def zamba2_config(**overrides: Any) -> Any:
    """Zamba2: Mamba2 layers and three hybrid layers running two shared attention+MLP blocks (block 0
    used twice), per-use LoRA adapters, RoPE in the shared attention, tied embeddings (which also
    ties the shared blocks' weights in HF)."""
    from transformers import Zamba2Config

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid", "linear_attention",
                                 "hybrid"],
              num_mem_blocks=2, num_attention_heads=4, use_shared_attention_adapter=True, adapter_rank=8,
              use_mem_rope=True, n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=2, mamba_d_conv=4,
              mamba_expand=2, chunk_size=16, max_position_embeddings=2048, tie_word_embeddings=True,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return Zamba2Config(**kw)


def falcon_h1_config(**overrides: Any) -> Any:
    """Falcon-H1: attention and Mamba2 in parallel in every layer, every muP multiplier away from 1,
    the gated RMS norm on (applied after the gate), projector biases."""
    from transformers import FalconH1Config

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
              mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
              mamba_rms_norm=True, mamba_norm_before_gate=False, projectors_bias=True,
              embedding_multiplier=1.5, lm_head_multiplier=0.8, key_multiplier=0.7, attention_in_multiplier=1.2,
              attention_out_multiplier=0.9, ssm_in_multiplier=1.1, ssm_out_multiplier=0.8,
              ssm_multipliers=[0.9, 1.2, 0.8, 1.1, 0.7], mlp_multipliers=[1.3, 0.75],
              max_position_embeddings=2048, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return FalconH1Config(**kw)


def minimax_config(**overrides: Any) -> Any:
    """MiniMax: lightning (linear) attention and softmax attention layers, each with a sparse MoE;
    blocks of 16 tokens, every residual alpha/beta factor away from 1. The decay of a lightning layer
    shrinks with its index (almost none in the last layers), and a bf16 state then drifts far (swamped
    updates): the last layers are softmax attention, as in MiniMax-Text-01, so that a bf16 state stays
    comparable with HF for the precision test's first 50 tokens."""
    from transformers import MiniMaxConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=6,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                           "full_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
              block_size=16, full_attn_alpha_factor=1.3, full_attn_beta_factor=0.9, linear_attn_alpha_factor=1.5,
              linear_attn_beta_factor=0.8, mlp_alpha_factor=1.2, mlp_beta_factor=1.1,
              max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return MiniMaxConfig(**kw)


def lfm2_config(**overrides: Any) -> Any:
    """LFM2: gated short-conv layers and attention layers with q/k norms (untied, so the LM head is scaled)."""
    from transformers import Lfm2Config

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, block_multiple_of=32, num_hidden_layers=6,
              layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
              num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, max_position_embeddings=2048,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return Lfm2Config(**kw)


def lfm2_moe_config(**overrides: Any) -> Any:
    """LFM2-MoE: LFM2's layers; the first layer dense, the others 8 experts top-2 with an expert bias."""
    from transformers import Lfm2MoeConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
              layer_types=["conv", "full_attention", "conv", "conv", "full_attention"], num_dense_layers=1,
              num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
              max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(overrides)
    return Lfm2MoeConfig(**kw)


def qwen3_next_config(**overrides: Any) -> Any:
    """Qwen3-Next: gated delta net (2 key heads shared by 4 value heads) and gated attention (partial
    RoPE); MoE with a shared expert on every layer but the dense ``mlp_only_layers`` one."""
    from transformers import Qwen3NextConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, mlp_only_layers=[2], decoder_sparse_step=1,
              max_position_embeddings=2048, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


#: the layers both Qwen3.5 test models share: Qwen3-Next's layers with separate gated-delta-net projections
#: (3 key heads shared by 6 value heads), gated attention with partial interleaved M-RoPE
_QWEN3_5_TEXT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4,
                     layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=3,
                     linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_conv_kernel_dim=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                      "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                     max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2)


def qwen3_5_config(**overrides: Any) -> Any:
    """Qwen3.5, dense: a SwiGLU MLP on every layer (128 wide: at 96 the bf16 model has a greedy near-tie, the
    two top logprobs 0.015 apart in float32, within the first 10 tokens of the kernel tests' prompts)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**_QWEN3_5_TEXT, "intermediate_size": 128, **overrides})


def qwen3_5_moe_config(**overrides: Any) -> Any:
    """Qwen3.5-MoE: a sparse MoE block (8 experts top-2, shared expert) on every layer."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**{**_QWEN3_5_TEXT, "num_experts": 8, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, **overrides})


#: a one-block vision tower, for the vision-language checkpoints (never run: served as text)
_QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                       temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def qwen3_5_vl_config(**overrides: Any) -> Any:
    """``Qwen3_5ForConditionalGeneration``: the dense model as ``text_config`` beside a tiny vision tower."""
    from transformers import Qwen3_5Config

    text = qwen3_5_config(**overrides)  # HF ties the embeddings by the top-level tie_word_embeddings
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=_QWEN3_5_VISION,
                         tie_word_embeddings=text.tie_word_embeddings)


def qwen3_5_moe_vl_config(**overrides: Any) -> Any:
    """``Qwen3_5MoeForConditionalGeneration``: the MoE model as ``text_config`` beside a tiny vision tower."""
    from transformers import Qwen3_5MoeConfig

    text = qwen3_5_moe_config(**overrides)
    return Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=_QWEN3_5_VISION,
                            tie_word_embeddings=text.tie_word_embeddings)


def olmo_hybrid_config(**overrides: Any) -> Any:
    """OLMo-Hybrid: gated delta net (4 key = 4 value heads, beta in [0, 2]) and post-norm attention with
    whole-projection q/k norms and RoPE, a SwiGLU MLP on every layer. Multi-head attention, as the config
    class's default (with 2 KV heads the state is 5.5 KV pages of 8 tokens, and the preemption test's pool,
    sized by pages, holds every request at once)."""
    from transformers import OlmoHybridConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=2048,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return OlmoHybridConfig(**kw)


def mamba_config(**overrides: Any) -> Any:
    """Mamba1, untied: tied, these tiny random models greedily repeat one token (logit gaps ~10)."""
    from transformers import MambaConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, state_size=16, conv_kernel=4, expand=2,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return MambaConfig(**kw)


def falcon_mamba_config(**overrides: Any) -> Any:
    """FalconMamba: Mamba1 with weightless RMS norms on dt, B, C; 4 layers (3 give a greedy near-tie
    within the first 50 tokens of the long decode)."""
    from transformers import FalconMambaConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, state_size=16, conv_kernel=4, expand=2,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return FalconMambaConfig(**kw)


def jamba_config(**overrides: Any) -> Any:
    """Jamba: 6 layers covering Mamba1+MoE (0, 2), attention+MLP (1), Mamba1+MLP (3, 5), attention+MoE (4).

    Chosen for a long greedy decode without near-ties in HF float32 and without top-k routing flips
    under bf16 state (a flipped expert jumps a logprob by ~0.5 at once; other layouts tried had one
    within 60 tokens)."""
    from transformers import JambaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
              expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
              mamba_expand=2, max_position_embeddings=2048, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return JambaConfig(**kw)


def xlstm_config(**overrides: Any) -> Any:
    """xLSTM: 3 mLSTM blocks of 4 heads (qk head 16, v head 32; hidden 128 so that HF's truncated layer dims
    and its cache's rounded ones agree), HF's logit soft cap, chunks of 16 (HF's prefill runs its chunkwise
    kernel over whole chunks, then steps the rest). Gates soft-capped at 3 rather than 15: HF's init gives
    forget-gate biases of 3 to 6 (memories of hundreds of tokens), over which a bf16 state's rounding grows
    past the near-ties of a random model within the precision test's first 50 tokens; capped at 3 (memories
    of about 20 tokens) a bf16 state stays comparable with HF that long (tests/engine/test_parity_variants.py runs
    the default cap of 15)."""
    from transformers import xLSTMConfig

    kw = dict(vocab_size=128, hidden_size=128, num_hidden_layers=3, num_heads=4, chunk_size=16, gate_soft_cap=3.0,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return xLSTMConfig(**kw)


def nemotron_h_latent_config(**overrides: Any) -> Any:
    """Nemotron-H whose routed experts work in a latent space (``moe_latent_size``), as in Nemotron-3 Super."""
    return nemotron_h_config(**{"moe_latent_size": 32, **overrides})


def lfm3_config(**overrides: Any) -> Any:
    """LFM3: short-conv, full-attention and sliding-window attention layers (q/k norms, per-head output
    gates, sandwich norms, proportional RoPE on the full layers). The window (8 tokens) is shorter than
    the test prompts and generations, so decoding runs past it; untied, so the LM head is scaled."""
    from transformers import Lfm3Config

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention", "conv"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, conv_L_cache=3, sliding_window=8,
              max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(overrides)
    return Lfm3Config(**kw)


def kimi_linear_config(**overrides: Any) -> Any:
    """Kimi Linear: KDA (4 heads of 16, per-channel decay) and NoPE MLA layers (4 heads, latent rank 64 +
    16 shared key dims, q_lora_rank 24 through q_a/q_b), a dense first MLP then an MoE of 8 SwiGLU experts
    top-2 in 2 groups (1 chosen) with a shared expert; untied, so the LM head is scaled.

    The latent is wide enough that a KV page of 8 tokens is a third of a state slot (with rank 32 the
    preemption test's pool, sized by pages, held every request at once); the expert width (40) is one whose
    long bf16-state decode has no greedy near-tie within its first 50 tokens (32, 48 and the others tried
    had one by token 2-45: bf16 state shifts logprobs ~1e-2 here, as OLMo-Hybrid's gated delta net does)."""
    from transformers import KimiLinearConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=24, qk_rope_head_dim=16,
              qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=2,
              topk_group=1, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return KimiLinearConfig(**kw)


BUILDERS: dict[str, Callable[..., Any]] = {
    "mamba": mamba_config,
    "falcon_mamba": falcon_mamba_config,
    "jamba": jamba_config,
    "qwen3_next": qwen3_next_config,
    "qwen3_5": qwen3_5_config,
    "qwen3_5_moe": qwen3_5_moe_config,
    "olmo_hybrid": olmo_hybrid_config,
    "minimax": minimax_config,
    "lfm2": lfm2_config,
    "lfm2_moe": lfm2_moe_config,
    "lfm3": lfm3_config,
    "zamba2": zamba2_config,
    "falcon_h1": falcon_h1_config,
    "granitemoehybrid": granitemoehybrid_config,
    "granitemoehybrid_dense": granitemoehybrid_dense_config,
    "nemotron_h": nemotron_h_config,
    "nemotron_h_latent": nemotron_h_latent_config,
    "bamba": bamba_config,
    "llama": llama_config,
    "mamba2": mamba2_config,
    "xlstm": xlstm_config,
    "kimi_linear": kimi_linear_config,
}


#: vision-language checkpoints (served as text), kept out of BUILDERS: their config is not a causal LM's
VL_BUILDERS: dict[str, Callable[..., Any]] = {
    "qwen3_5_vl": qwen3_5_vl_config,
    "qwen3_5_moe_vl": qwen3_5_moe_vl_config,
}


def make(tmp_dir: str, family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> str:
    tag = hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8] if overrides else "base"
    path = os.path.join(tmp_dir, f"{family}-{str(dtype).removeprefix('torch.')}-{seed}-{tag}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build({**BUILDERS, **VL_BUILDERS, **DEFAULTS_BUILDERS}[family](**overrides), path, seed=seed, dtype=dtype)
    return path


# ----------------------------------------------------------------------------------- multi-token prediction
def _qwen3_next_mtp_shapes(cfg: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next / Qwen3.5 ``mtp.*`` names and shapes (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py layout), one
    full-attention layer per MTP module with the MoE of the model (or its dense MLP), experts per expert."""
    h = cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or h // heads
    shapes: dict[str, tuple[int, ...]] = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                                          "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    num_experts = cfg.get("num_experts") or 0
    for i in range(num_layers):
        p = f"mtp.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (2 * heads * dh, h),  # per head [query, gate]
                       p + "self_attn.k_proj.weight": (kv_heads * dh, h),
                       p + "self_attn.v_proj.weight": (kv_heads * dh, h),
                       p + "self_attn.o_proj.weight": (h, heads * dh), p + "self_attn.q_norm.weight": (dh,),
                       p + "self_attn.k_norm.weight": (dh,)})
        moe = (num_experts > 0 and i not in (cfg.get("mlp_only_layers") or [])
               and (i + 1) % (cfg.get("decoder_sparse_step") or 1) == 0)
        if moe:
            inter, shared = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (num_experts, h)
            for e in range(num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (inter, h), q + "up_proj.weight": (inter, h),
                               q + "down_proj.weight": (h, inter)})
            shapes.update({p + "mlp.shared_expert.gate_proj.weight": (shared, h),
                           p + "mlp.shared_expert.up_proj.weight": (shared, h),
                           p + "mlp.shared_expert.down_proj.weight": (h, shared),
                           p + "mlp.shared_expert_gate.weight": (1, h)})
        else:
            inter = cfg["intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
    return shapes


#: the MTP module of the Nemotron-H test checkpoints: an attention block, then an MoE block (Nemotron-3 Super's)
NEMOTRON_H_MTP_KINDS = ["full_attention", "moe"]


def _nemotron_h_mtp_shapes(cfg: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Nemotron-H ``mtp.layers.{k}.*`` names and shapes (vLLM's nemotron_h_mtp.py layout), blocks of the kinds
    ``NEMOTRON_H_MTP_KINDS`` per module; the first block fuses (enorm, hnorm, eh_proj), the last ends in
    final_layernorm."""
    h = cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or h // heads
    shapes: dict[str, tuple[int, ...]] = {}
    kinds = NEMOTRON_H_MTP_KINDS
    for k in range(num_layers * len(kinds)):
        p, j = f"mtp.layers.{k}.", k % len(kinds)
        shapes[p + "norm.weight"] = (h,)
        if j == 0:
            shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h)})
        if j == len(kinds) - 1:
            shapes[p + "final_layernorm.weight"] = (h,)
        if kinds[j] == "full_attention":
            shapes.update({p + "mixer.q_proj.weight": (heads * dh, h), p + "mixer.k_proj.weight": (kv_heads * dh, h),
                           p + "mixer.v_proj.weight": (kv_heads * dh, h), p + "mixer.o_proj.weight": (h, heads * dh)})
        else:
            e_num, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            shared = cfg["moe_shared_expert_intermediate_size"]
            d_in = cfg.get("moe_latent_size") or h
            shapes.update({p + "mixer.gate.weight": (e_num, h), p + "mixer.gate.e_score_correction_bias": (e_num,),
                           p + "mixer.shared_experts.up_proj.weight": (shared, h),
                           p + "mixer.shared_experts.down_proj.weight": (h, shared)})
            for e in range(e_num):
                shapes.update({f"{p}mixer.experts.{e}.up_proj.weight": (inter, d_in),
                               f"{p}mixer.experts.{e}.down_proj.weight": (d_in, inter)})
            if cfg.get("moe_latent_size"):
                shapes.update({p + "mixer.fc1_latent_proj.weight": (d_in, h),
                               p + "mixer.fc2_latent_proj.weight": (h, d_in)})
    return shapes


def add_mtp_weights(path: str, num_layers: int = 1, seed: int = 0, std: float = 0.08, out: str | None = None) -> str:
    """A copy of the checkpoint at ``path`` with random multi-token-prediction weights: every ``mtp.*`` tensor
    of the family's published layout (real names and shapes) added to its safetensors, and the MTP layer
    count in its config.json (Qwen3-Next / Qwen3.5: ``mtp_num_hidden_layers``, in ``text_config`` for a
    vision-language checkpoint; Nemotron-H: ``num_nextn_predict_layers`` and ``mtp_layers_block_type``).
    Norm weights are small around their identity (zero-centered for Qwen), matrices ``N(0, std)``.
    ``path`` is left unchanged; the copy goes to ``out`` (default ``{path}-mtp{num_layers}-s{seed}``), reused
    when it exists. Returns the copy's path."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = out or f"{path}-mtp{num_layers}-s{seed}"
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config") or config
    if config.get("model_type") == "nemotron_h":
        text.update(num_nextn_predict_layers=num_layers, mtp_layers_block_type=list(NEMOTRON_H_MTP_KINDS))
        shapes, zero_centered = _nemotron_h_mtp_shapes(text, num_layers), False
    elif str(config.get("model_type", "")).startswith(("qwen3_next", "qwen3_5")):
        text["mtp_num_hidden_layers"] = num_layers
        shapes, zero_centered = _qwen3_next_mtp_shapes(text, num_layers), True
    else:
        raise ValueError(f"no MTP layout for model_type {config.get('model_type')!r}")
    files = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {path!r}, found {files}")
    weights = load_file(os.path.join(tmp, files[0]))
    dtype = next(iter(weights.values())).dtype
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        if len(shape) >= 2:
            t = torch.randn(shape, generator=gen) * std
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=gen) * 0.1
        else:  # a norm weight: gamma - 1 (zero-centered) or gamma, a little off its identity
            t = torch.randn(shape, generator=gen) * 0.1 + (0.0 if zero_centered else 1.0)
        weights[name] = t.to(dtype)
    save_file(weights, os.path.join(tmp, files[0]), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, out)
    return out
