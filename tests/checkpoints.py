"""Tiny random checkpoints built with transformers' own config classes, saved with save_pretrained."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

LM_HEAD_SCALE = 4.0


def _peaky(model: Any, scale: float, std: float) -> None:
    """Larger init so logits are peaky and greedy decoding is stable on a random model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
        if getattr(model.config, "tie_word_embeddings", False):
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith("weight") and ("final" in name or name.endswith("model.norm.weight") or "norm_f" in name):
                    p.mul_(scale)
        else:
            model.lm_head.weight.mul_(scale)


def save_checkpoint(model: Any, path: str, dtype: torch.dtype = torch.float32) -> str:
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(path)
    return path


def build(config: Any, path: str, seed: int = 0, std: float = 0.08, dtype: torch.dtype = torch.float32) -> str:
    """Instantiate ``config``'s causal LM with random weights and save it to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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


BUILDERS: dict[str, Callable[..., Any]] = {
    "bamba": bamba_config,
    "llama": llama_config,
    "mamba2": mamba2_config,
}


def make(tmp_dir: str, family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> str:
    path = os.path.join(tmp_dir, f"{family}-{str(dtype).removeprefix('torch.')}-{seed}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build(BUILDERS[family](**overrides), path, seed=seed, dtype=dtype)
    return path
