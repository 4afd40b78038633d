"""The model families: one record per architecture, the one place that lists them.

A record names the model class (imported lazily: this module imports no torch), the HF ``model_type``s that
map to it, its torch-free cache specs for ``hybridserve plan`` (``models/family_specs.py``), its config class's
default ``max_position_embeddings``, and whether it runs tensor-parallel. Adding a family is its model file
plus one row here (and a spec function in ``family_specs.py`` to plan it without torch).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.models import family_specs as fs

SpecsFunction = Callable[[Any, CacheDtypes], list[LayerCacheSpec]]


@dataclass(frozen=True)
class ModelFamily:
    """One architecture: where its model class lives and what is known of it without torch."""

    architecture: str
    module: str  # under hybridserve.models, or a full dotted path
    model_types: tuple[str, ...] = ()
    #: every layer's cache spec from the config alone (None: planned from the model built on the meta device)
    plan_specs: SpecsFunction | None = None
    default_max_positions: int | None = None  # the config class's default (None: it has none)
    #: the positions the config class sets whatever the file says, or None (Zamba2's long context)
    fixed_positions: Callable[[Any], int | None] | None = None
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
    ModelFamily("LlamaForCausalLM", "llama", ("llama",), fs.llama_specs, 2048),
    ModelFamily("MambaForCausalLM", "mamba", ("mamba",), fs.mamba_specs),
    ModelFamily("FalconMambaForCausalLM", "falcon_mamba", ("falcon_mamba",), fs.mamba_specs,
                class_name="FalconMambaLM"),
    ModelFamily("Mamba2ForCausalLM", "mamba2", ("mamba2",), fs.mamba2_specs),
    ModelFamily("BambaForCausalLM", "bamba", ("bamba",), fs.bamba_specs, 262144),
    ModelFamily("GraniteMoeHybridForCausalLM", "granitemoehybrid", ("granitemoehybrid",), fs.granitemoehybrid_specs,
                2048),
    ModelFamily("JambaForCausalLM", "jamba", ("jamba",), fs.jamba_specs, 262144),
    ModelFamily("NemotronHForCausalLM", "nemotron_h", ("nemotron_h",), fs.nemotron_h_specs, 4096,
                mtp_count_key="num_nextn_predict_layers",  # mtp_config.NEMOTRON_H_MTP_COUNT_KEY
                mtp_head="mtp_nemotron_h:NemotronHMTPHead"),
    ModelFamily("Qwen3NextForCausalLM", "qwen3_next", ("qwen3_next",), fs.qwen3_next_specs, 32768,
                mtp_count_key=_QWEN_MTP, mtp_head="mtp_qwen3_next:Qwen3NextMTPHead"),
    ModelFamily("MiniMaxForCausalLM", "minimax", ("minimax",), fs.minimax_specs, 131072),
    ModelFamily("Lfm2ForCausalLM", "lfm2", ("lfm2",), fs.lfm2_specs, 128000),
    ModelFamily("Lfm2MoeForCausalLM", "lfm2_moe", ("lfm2_moe",), fs.lfm2_moe_specs, 128000),
    ModelFamily("Lfm3ForCausalLM", "lfm3", ("lfm3",), fs.lfm3_specs, 128000),
    ModelFamily("Zamba2ForCausalLM", "zamba2", ("zamba2",), fs.zamba2_specs, 4096, fs.zamba2_positions),
    ModelFamily("FalconH1ForCausalLM", "falcon_h1", ("falcon_h1",), fs.falcon_h1_specs, 8192),
    ModelFamily("xLSTMForCausalLM", "xlstm", ("xlstm",), fs.xlstm_specs),
    ModelFamily("Qwen3_5ForCausalLM", "qwen3_5", ("qwen3_5_text",), fs.qwen3_5_specs, 32768,
                mtp_count_key=_QWEN_MTP),
    ModelFamily("Qwen3_5MoeForCausalLM", "qwen3_5", ("qwen3_5_moe_text",), fs.qwen3_5_moe_specs, 32768,
                mtp_count_key=_QWEN_MTP),
    ModelFamily("Qwen3_5ForConditionalGeneration", "qwen3_5", ("qwen3_5",), fs.qwen3_5_specs, 32768,
                served_as_text=True, mtp_count_key=_QWEN_MTP),
    ModelFamily("Qwen3_5MoeForConditionalGeneration", "qwen3_5", ("qwen3_5_moe",), fs.qwen3_5_moe_specs, 32768,
                served_as_text=True, mtp_count_key=_QWEN_MTP),
    ModelFamily("OlmoHybridForCausalLM", "olmo_hybrid", ("olmo_hybrid",), fs.olmo_hybrid_specs, 65536),
    ModelFamily("KimiLinearForCausalLM", "kimi_linear", ("kimi_linear",), fs.kimi_linear_specs, 1048576),
)

#: architecture -> its record (``register`` adds to it)
_MODELS: dict[str, ModelFamily] = {family.architecture: family for family in _FAMILIES}

#: vision-language architectures served as text: their config's ``text_config`` is the served model's config
#: (``loader.load_hf_config``, ``config_specs.read_config``); image inputs are not accepted
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
