"""The model families: one record per architecture, the one place that lists them.

A record names the model class (imported lazily: this module imports no torch), the HF ``model_type``s that
map to it, whether it runs tensor-parallel, and its multi-token-prediction keys. Everything else is the model
file's: its layer kinds decoded from the config, each layer's cache spec (``layers/state_shapes.py``, which
``hybridserve plan`` reaches through the model built on the meta device) and transformers' config class for the
defaults. Adding a family is its model file plus one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    """One architecture: where its model class lives and what the engine needs to know of it before building it."""

    architecture: str
    module: str  # under hybridserve.models, or a full dotted path
    model_types: tuple[str, ...] = ()
    tensor_parallel: bool = True  # every layer is sharded by ``distributed/sharding.py``
    served_as_text: bool = False  # vision-language: ``text_config`` is the served model's (no image inputs)
    #: the config key counting its multi-token-prediction modules (``models/mtp_config.py``), or None
    mtp_count_key: str | None = None
    #: its MTP head class as "module:Class" (``models/mtp.py``; a subclass's model finds it through its bases)
    mtp_head: str | None = None
    class_name: str = ""  # defaults to ``architecture``

    @property
    def module_path(self) -> str:
        return self.module if "." in self.module else f"hybridserve.models.{self.module}"

    @property
    def model_class_name(self) -> str:
        return self.class_name or self.architecture


_QWEN_MTP = "mtp_num_hidden_layers"
_FAMILIES = (
    ModelFamily("LlamaForCausalLM", "llama", ("llama",)),
    ModelFamily("MambaForCausalLM", "mamba", ("mamba",)),
    ModelFamily("FalconMambaForCausalLM", "falcon_mamba", ("falcon_mamba",), class_name="FalconMambaLM"),
    ModelFamily("Mamba2ForCausalLM", "mamba2", ("mamba2",)),
    ModelFamily("BambaForCausalLM", "bamba", ("bamba",)),
    ModelFamily("GraniteMoeHybridForCausalLM", "granitemoehybrid", ("granitemoehybrid",)),
    ModelFamily("JambaForCausalLM", "jamba", ("jamba",)),
    ModelFamily("NemotronHForCausalLM", "nemotron_h", ("nemotron_h",),
                mtp_count_key="num_nextn_predict_layers",  # mtp_config.NEMOTRON_H_MTP_COUNT_KEY
                mtp_head="mtp_nemotron_h:NemotronHMTPHead"),
    ModelFamily("Qwen3NextForCausalLM", "qwen3_next", ("qwen3_next",),
                mtp_count_key=_QWEN_MTP, mtp_head="mtp_qwen3_next:Qwen3NextMTPHead"),
    ModelFamily("MiniMaxForCausalLM", "minimax", ("minimax",)),
    ModelFamily("Lfm2ForCausalLM", "lfm2", ("lfm2",)),
    ModelFamily("Lfm2MoeForCausalLM", "lfm2_moe", ("lfm2_moe",)),
    ModelFamily("Lfm3ForCausalLM", "lfm3", ("lfm3",)),
    ModelFamily("Zamba2ForCausalLM", "zamba2", ("zamba2",)),
    ModelFamily("FalconH1ForCausalLM", "falcon_h1", ("falcon_h1",)),
    ModelFamily("xLSTMForCausalLM", "xlstm", ("xlstm",)),
    ModelFamily("Qwen3_5ForCausalLM", "qwen3_5", ("qwen3_5_text",),
                mtp_count_key=_QWEN_MTP),
    ModelFamily("Qwen3_5MoeForCausalLM", "qwen3_5", ("qwen3_5_moe_text",),
                mtp_count_key=_QWEN_MTP),
    ModelFamily("Qwen3_5ForConditionalGeneration", "qwen3_5", ("qwen3_5",),
                served_as_text=True, mtp_count_key=_QWEN_MTP),
    ModelFamily("Qwen3_5MoeForConditionalGeneration", "qwen3_5", ("qwen3_5_moe",),
                served_as_text=True, mtp_count_key=_QWEN_MTP),
    ModelFamily("OlmoHybridForCausalLM", "olmo_hybrid", ("olmo_hybrid",)),
    ModelFamily("KimiLinearForCausalLM", "kimi_linear", ("kimi_linear",)),
)

#: architecture -> its record (``register`` adds to it)
_MODELS: dict[str, ModelFamily] = {family.architecture: family for family in _FAMILIES}

#: vision-language architectures served as text: their config's ``text_config`` is the served model's config
#: (``loader.load_hf_config``, ``config_file.read_config_values``); image inputs are not accepted
SERVED_AS_TEXT = frozenset(f.architecture for f in _FAMILIES if f.served_as_text)


def register(architecture: str, module: str, class_name: str) -> None:
    """Register a model class under its HF architecture name (planned from its model, not tensor-parallel)."""
    _MODELS[architecture] = ModelFamily(architecture, module, class_name=class_name, tensor_parallel=False)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def family(architecture: str) -> ModelFamily | None:
    """The record of ``architecture``, or None when it is not registered."""
    return _MODELS.get(architecture)


def families() -> tuple[ModelFamily, ...]:
    """Every registered family's record."""
    return tuple(_MODELS.values())


def model_class(architecture: str) -> type:
    """The model class for an HF architecture name, or a ValueError listing the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: "
                         + ", ".join(supported_architectures()))
    record = _MODELS[architecture]
    return getattr(importlib.import_module(record.module_path), record.model_class_name)


def mtp_head_class(model_class: type) -> type | None:
    """The MTP head class of a model class's family (looked up by the modules of its bases, so Qwen3.5's model
    finds Qwen3-Next's head), or None for a family without one."""
    for cls in model_class.__mro__:
        for record in _MODELS.values():
            if record.mtp_head is not None and record.module_path == cls.__module__:
                module, name = record.mtp_head.split(":")
                return getattr(importlib.import_module(f"hybridserve.models.{module}"), name)
    return None


def model_types() -> dict[str, str]:
    """HF ``model_type`` -> the architecture the registry knows it by."""
    return {t: f.architecture for f in _MODELS.values() for t in f.model_types}


def architecture_of(config: Any) -> str:
    """The config's architecture: ``architectures[0]``, else the one its ``model_type`` maps to (ValueError naming
    the allowed model types otherwise)."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    by_type = model_types()
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError("config.json names no architecture ('architectures' is empty) and no model_type; "
                         f"allowed model_types: {', '.join(sorted(by_type))}")
    if model_type not in by_type:
        raise ValueError(f"config.json names no architecture and model_type={model_type!r} is not supported; "
                         f"allowed model_types: {', '.join(sorted(by_type))}")
    return by_type[model_type]


def tensor_parallel_architectures() -> tuple[str, ...]:
    """The architectures whose every layer is sharded (any other is refused under tensor parallelism)."""
    return tuple(f.architecture for f in _MODELS.values() if f.tensor_parallel)
