"""Every family's config class at its transformers defaults, only the sizes made tiny.

``tests/checkpoints.py`` builds each family with options chosen to exercise its code (multipliers away
from 1, norms on, biases on, ...). The checkpoints here keep every *option* of the config class at its
default, as a user gets it from ``FamilyConfig()``: only the sizes change (hidden size, layer count,
head counts and head sizes, vocabulary, state and expert counts and widths, position table), with the
size-dependent lists a layer count forces (a layer pattern of the class's own shape) and token ids
moved inside the tiny vocabulary. Chunk and block sizes, conv widths, layer patterns the class derives
from the layer count, activations, eps and every flag stay as the class sets them.
"""

from __future__ import annotations

from typing import Any, Callable

VOCAB = 128
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")

#: family -> (config class name, size overrides)
SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba": ("MambaConfig", dict(hidden_size=64, num_hidden_layers=3)),
    "falcon_mamba": ("FalconMambaConfig", dict(hidden_size=64, num_hidden_layers=3)),
    # 8 layers: the class's attention period (8, offset 4) and expert period (2) both appear
    "jamba": ("JambaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                                  num_key_value_heads=1, max_position_embeddings=2048)),
    "qwen3_next": ("Qwen3NextConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                           num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=16, num_experts=16, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, max_position_embeddings=2048)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=16, max_position_embeddings=2048)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                                                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=16,
                                                 linear_value_head_dim=16, num_experts=16, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32, max_position_embeddings=2048)),
    # linear heads and head sizes derived by the class (heads = attention heads, key 0.75 hidden / heads)
    "olmo_hybrid": ("OlmoHybridConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=4,
                                             max_position_embeddings=2048)),
    "minimax": ("MiniMaxConfig", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048)),
    "lfm2": ("Lfm2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=1, max_position_embeddings=2048)),
    # the class leaves layer_types None (its model cannot be built so): LFM2-MoE's conv/attention mix
    "lfm2_moe": ("Lfm2MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                                       layer_types=["conv", "full_attention", "conv", "conv"],
                                       max_position_embeddings=2048)),
    "lfm3": ("Lfm3Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=16, max_position_embeddings=2048)),
    # the class's 54-layer pattern (a hybrid layer every sixth) at six layers
    "zamba2": ("Zamba2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                                    num_key_value_heads=4, mamba_d_state=16,
                                    layers_block_type=["linear_attention"] * 5 + ["hybrid"],
                                    max_position_embeddings=2048)),
    "falcon_h1": ("FalconH1Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=1, mamba_d_ssm=128,
                                         mamba_n_heads=16, mamba_d_head=8, mamba_d_state=16,
                                         max_position_embeddings=2048)),
    # one attention layer in Granite's and Bamba's patterns (:data:`ATTENTION_PATTERNS`)
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(hidden_size=64, intermediate_size=32,
                                                        shared_intermediate_size=48, num_hidden_layers=4,
                                                        num_attention_heads=4, num_key_value_heads=4,
                                                        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16)),
    "nemotron_h": ("NemotronHConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                           intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
                                           ssm_state_size=16, moe_intermediate_size=32,
                                           moe_shared_expert_intermediate_size=48, max_position_embeddings=2048)),
    "bamba": ("BambaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=1, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                                  max_position_embeddings=2048)),
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=4, head_dim=16)),
    "mamba2": ("Mamba2Config", dict(hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16)),
    "xlstm": ("xLSTMConfig", dict(hidden_size=128, num_hidden_layers=3)),
    # the class's pattern at five layers: four KDA layers, then attention; a dense first MLP, then experts
    "kimi_linear": ("KimiLinearConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                             num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
                                             kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                             num_experts=16, linear_head_dim=16, linear_num_heads=4)),
}


#: families whose config class defaults to Mamba2 layers only, which HF's ``generate`` cannot run (its cache has
#: no attention layer to count the sequence length): ``<family>_defaults`` puts one attention layer in, and
#: ``<family>_defaults_mamba_only`` keeps the class's pattern (compared with HF's uncached forward instead)
ATTENTION_PATTERNS: dict[str, dict[str, Any]] = {
    "granitemoehybrid": dict(layer_types=["mamba", "mamba", "attention", "mamba"]),
    "bamba": dict(attn_layer_indices=[2]),
}


def defaults_config(family: str, class_pattern: bool = False) -> Any:
    """``family``'s config class at its defaults with the tiny sizes of :data:`SIZES` (and, unless
    ``class_pattern``, the layer pattern of :data:`ATTENTION_PATTERNS`); a token id the class defaults
    outside the tiny vocabulary becomes 0 (pad), 1 (bos) or 2 (eos)."""
    import transformers

    class_name, sizes = SIZES[family]
    if not class_pattern:
        sizes = {**sizes, **ATTENTION_PATTERNS.get(family, {})}
    config_class = getattr(transformers, class_name)
    defaults = config_class()
    ids = {name: fallback for fallback, name in enumerate(_TOKEN_IDS)
           if isinstance(getattr(defaults, name, None), int) and getattr(defaults, name) >= VOCAB}
    return config_class(vocab_size=VOCAB, **sizes, **ids)


#: ``<family>_defaults`` -> a builder taking no overrides but ``tests/checkpoints.make``'s keywords
DEFAULTS_BUILDERS: dict[str, Callable[..., Any]] = {
    **{f"{family}_defaults": (lambda family=family, **overrides: _with(defaults_config(family), overrides))
       for family in SIZES},
    **{f"{family}_defaults_mamba_only": (lambda family=family, **overrides: _with(defaults_config(family, True),
                                                                                   overrides))
       for family in ATTENTION_PATTERNS},
}


def _with(config: Any, overrides: dict[str, Any]) -> Any:
    for name, value in overrides.items():
        setattr(config, name, value)
    return config
