"""Architecture name -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("hybridserve.models.llama", "LlamaForCausalLM"),
    "Mamba2ForCausalLM": ("hybridserve.models.mamba2", "Mamba2ForCausalLM"),
    "BambaForCausalLM": ("hybridserve.models.bamba", "BambaForCausalLM"),
    "MambaForCausalLM": ("hybridserve.models.mamba", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("hybridserve.models.falcon_mamba", "FalconMambaForCausalLM"),
    "JambaForCausalLM": ("hybridserve.models.jamba", "JambaForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("hybridserve.models.granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("hybridserve.models.nemotron_h", "NemotronHForCausalLM"),
    "Qwen3NextForCausalLM": ("hybridserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "MiniMaxForCausalLM": ("hybridserve.models.minimax", "MiniMaxForCausalLM"),
    "Lfm2ForCausalLM": ("hybridserve.models.lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("hybridserve.models.lfm2_moe", "Lfm2MoeForCausalLM"),
    "Lfm3ForCausalLM": ("hybridserve.models.lfm3", "Lfm3ForCausalLM"),
    "Zamba2ForCausalLM": ("hybridserve.models.zamba2", "Zamba2ForCausalLM"),
    "FalconH1ForCausalLM": ("hybridserve.models.falcon_h1", "FalconH1ForCausalLM"),
    "xLSTMForCausalLM": ("hybridserve.models.xlstm", "xLSTMForCausalLM"),
    "Qwen3_5ForCausalLM": ("hybridserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("hybridserve.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("hybridserve.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("hybridserve.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "OlmoHybridForCausalLM": ("hybridserve.models.olmo_hybrid", "OlmoHybridForCausalLM"),
    "KimiLinearForCausalLM": ("hybridserve.models.kimi_linear", "KimiLinearForCausalLM"),
}

#: vision-language architectures served as text: their config's ``text_config`` is the served model's config
#: (``loader.load_hf_config``, ``config_specs.read_config``); image inputs are not accepted
SERVED_AS_TEXT = frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"})


def register(architecture: str, module: str, class_name: str) -> None:
    """Register a model class under its HF architecture name."""
    _MODELS[architecture] = (module, class_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    """The model class for an HF architecture name, or a ValueError listing the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: "
                         + ", ".join(supported_architectures()))
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
