"""Real-size configs of the supported families, built with transformers' own config classes.

One entry per family: ``(architecture, config builder)``. Adding a family is one line.
Dimensions are the published checkpoints' (no weights are needed: models are built on ``meta``).
"""

from __future__ import annotations

from typing import Any, Callable


def _arch(config: Any, architecture: str) -> Any:
    config.architectures = [architecture]
    return config


def llama_3_8b() -> Any:
    from transformers import LlamaConfig

    return _arch(LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                             dtype="bfloat16"), "LlamaForCausalLM")


def mamba_codestral_7b() -> Any:
    from transformers import Mamba2Config

    return _arch(Mamba2Config(vocab_size=32768, hidden_size=4096, num_hidden_layers=64, num_heads=128, head_dim=64,
                              state_size=128, n_groups=8, conv_kernel=4, expand=2, dtype="bfloat16"),
                 "Mamba2ForCausalLM")


def bamba_9b() -> Any:
    from transformers import BambaConfig

    return _arch(BambaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[9, 18, 27],
                             mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
                             mamba_d_conv=4, mamba_expand=2, max_position_embeddings=262144, dtype="bfloat16"),
                 "BambaForCausalLM")


def granite_4_0_h_small() -> Any:
    from transformers import GraniteMoeHybridConfig

    layer_types = ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]
    return _arch(GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=4096, intermediate_size=768, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=72, num_experts_per_tok=10, shared_intermediate_size=8192,
        layer_types=layer_types, mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, position_embedding_type="nope", max_position_embeddings=131072,
        dtype="bfloat16"), "GraniteMoeHybridForCausalLM")


def nemotron_h_8b() -> Any:
    from transformers import NemotronHConfig

    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    kinds = {"M": "mamba", "-": "mlp", "*": "attention"}
    return _arch(NemotronHConfig(
        vocab_size=131072, hidden_size=4096, layers_block_type=[kinds[c] for c in pattern], num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=21504, ssm_state_size=128, mamba_num_heads=128,
        mamba_head_dim=64, n_groups=8, conv_kernel=4, expand=2, max_position_embeddings=8192, dtype="bfloat16"),
        "NemotronHForCausalLM")


def qwen3_next_80b_a3b() -> Any:
    from transformers import Qwen3NextConfig

    return _arch(Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        max_position_embeddings=262144, dtype="bfloat16"), "Qwen3NextForCausalLM")


def jamba_v0_1() -> Any:
    from transformers import JambaConfig

    return _arch(JambaConfig(
        vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_experts=16, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=256, max_position_embeddings=262144, dtype="bfloat16"), "JambaForCausalLM")


def falcon_h1_7b() -> Any:
    from transformers import FalconH1Config

    return _arch(FalconH1Config(
        vocab_size=130048, hidden_size=3072, intermediate_size=12288, num_hidden_layers=44, num_attention_heads=12,
        num_key_value_heads=2, mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_n_groups=1,
        mamba_d_state=256, mamba_d_conv=4, mamba_expand=2, max_position_embeddings=262144, dtype="bfloat16"),
        "FalconH1ForCausalLM")


def zamba2_7b() -> Any:
    from transformers import Zamba2Config

    kinds = ["hybrid" if i % 6 == 5 else "mamba" for i in range(81)]
    return _arch(Zamba2Config(
        vocab_size=32000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=81, layers_block_type=kinds,
        mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=112,
        num_attention_heads=32, num_key_value_heads=32, num_mem_blocks=2, max_position_embeddings=4096,
        dtype="bfloat16"), "Zamba2ForCausalLM")


def lfm2_1_2b() -> Any:
    from transformers import Lfm2Config

    return _arch(Lfm2Config(
        vocab_size=65536, hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, full_attn_idxs=[2, 5, 8, 10, 12, 14], conv_L_cache=3, max_position_embeddings=128000,
        dtype="bfloat16"), "Lfm2ForCausalLM")


def lfm2_moe_defaults() -> Any:
    """Lfm2MoeConfig's defaults (2048 hidden, 32 layers, 32 experts top-4); the defaults set no
    ``layer_types``, so attention takes one layer in four here."""
    from transformers import Lfm2MoeConfig

    kinds = ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]
    return _arch(Lfm2MoeConfig(layer_types=kinds, dtype="bfloat16"), "Lfm2MoeForCausalLM")


def qwen3_5_defaults() -> Any:
    """Qwen3_5TextConfig's defaults (4096 hidden, 32 layers, attention every fourth, 32 value heads of the gated
    delta net, 4 KV heads of 256)."""
    from transformers import Qwen3_5TextConfig

    return _arch(Qwen3_5TextConfig(dtype="bfloat16"), "Qwen3_5ForCausalLM")


def qwen3_5_moe_vl_defaults() -> Any:
    """Qwen3_5MoeConfig's defaults (text: 2048 hidden, 40 layers, 256 experts top-8, 2 KV heads of 256), served as
    text the engine's way (``loader.served_text_config``)."""
    from transformers import Qwen3_5MoeConfig

    from hybridserve.models.loader import served_text_config

    return served_text_config(_arch(Qwen3_5MoeConfig(dtype="bfloat16"), "Qwen3_5MoeForConditionalGeneration"))


def olmo_hybrid_defaults() -> Any:
    """OlmoHybridConfig's defaults (3840 hidden, 32 layers, attention every fourth, 30 heads of 128; gated delta
    net 30 heads, keys 96, values 192)."""
    from transformers import OlmoHybridConfig

    return _arch(OlmoHybridConfig(dtype="bfloat16"), "OlmoHybridForCausalLM")


def xlstm_7b() -> Any:
    """xLSTMConfig's defaults, NX-AI's xLSTM-7b (4096 hidden, 32 mLSTM blocks of 8 heads, qk heads 256, v heads
    512; no attention). The checkpoint's triton kernel names are left at the native ones: transformers rejects
    the others without the ``xlstm`` package, and they choose how, not what, HF computes."""
    from transformers import xLSTMConfig

    return _arch(xLSTMConfig(dtype="bfloat16"), "xLSTMForCausalLM")


def falcon_mamba_7b() -> Any:
    from transformers import FalconMambaConfig

    return _arch(FalconMambaConfig(vocab_size=65024, hidden_size=4096, state_size=16, num_hidden_layers=64,
                                   expand=2, conv_kernel=4, time_step_rank=256, dtype="bfloat16"),
                 "FalconMambaForCausalLM")


def minimax_text_01() -> Any:
    from transformers import MiniMaxConfig

    kinds = ["full_attention" if i % 8 == 7 else "linear_attention" for i in range(80)]
    return _arch(MiniMaxConfig(
        vocab_size=200064, hidden_size=6144, intermediate_size=9216, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, num_local_experts=32, num_experts_per_tok=2, layer_types=kinds,
        max_position_embeddings=10240000, dtype="bfloat16"), "MiniMaxForCausalLM")


def lfm3_defaults() -> Any:
    """Lfm3Config's defaults (LFM3-1.7B: 2048 hidden, 24 layers: 13 short-conv, 6 full-attention and 5
    sliding-window attention layers with a 256-token window, 4 KV heads of 128)."""
    from transformers import Lfm3Config

    return _arch(Lfm3Config(dtype="bfloat16"), "Lfm3ForCausalLM")


#: configs with a window page group (sliding-window layers beside full ones): their sequences hold the window
def kimi_linear_defaults() -> Any:
    """KimiLinearConfig's defaults (Kimi-Linear-48B-A3B: 2304 hidden, 27 layers, MLA on every fourth from layer 4
    with a 512 + 64 latent, 32 KDA heads of 128, 256 experts top-8)."""
    from transformers import KimiLinearConfig

    return _arch(KimiLinearConfig(dtype="bfloat16"), "KimiLinearForCausalLM")


#: layers' KV for the last ``window`` tokens only, in pages sized as the larger group's
#: (tests/cache/test_sliding_window.py checks their planner bytes exactly; they are kept out of REAL_CONFIGS' 1% bar,
#: which a window group's page padding and its one extra page per sequence do not meet at 1,000 tokens)
WINDOWED_CONFIGS: dict[str, Callable[[], Any]] = {
    "lfm3-defaults": lfm3_defaults,
}


#: family -> config builder; a family whose model class is not registered yet is skipped by the tests
REAL_CONFIGS: dict[str, Callable[[], Any]] = {
    "llama-3-8b": llama_3_8b,
    "mamba-codestral-7b": mamba_codestral_7b,
    "bamba-9b": bamba_9b,
    "granite-4.0-h-small": granite_4_0_h_small,
    "nemotron-h-8b": nemotron_h_8b,
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "jamba-v0.1": jamba_v0_1,
    "falcon-h1-7b": falcon_h1_7b,
    "zamba2-7b": zamba2_7b,
    "lfm2-1.2b": lfm2_1_2b,
    "lfm2-moe-defaults": lfm2_moe_defaults,
    "qwen3.5-defaults": qwen3_5_defaults,
    "qwen3.5-moe-vl-defaults": qwen3_5_moe_vl_defaults,
    "olmo-hybrid-defaults": olmo_hybrid_defaults,
    "falcon-mamba-7b": falcon_mamba_7b,
    "xlstm-7b": xlstm_7b,
    "minimax-text-01": minimax_text_01,
    "kimi-linear-defaults": kimi_linear_defaults,
}
