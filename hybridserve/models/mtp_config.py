"""How many multi-token-prediction (MTP) modules a config declares and which blocks they hold, from the
config alone (no torch: ``hybridserve plan`` reads it, as does the head builder in ``models/mtp.py``)."""

from __future__ import annotations

from typing import Any

from hybridserve.models import registry
from hybridserve.models.registry import architecture_of

#: the config key counting Nemotron-H's MTP modules (each holds blocks of several kinds; Qwen's, one layer)
NEMOTRON_H_MTP_COUNT_KEY = "num_nextn_predict_layers"
NEMOTRON_H_MTP_KINDS = ("full_attention", "moe", "mlp")
#: the older one-character spelling of Nemotron-H block kinds (``mtp_hybrid_override_pattern``), and older names
NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
NEMOTRON_ALIASES = {"mamba": "linear_attention", "attention": "full_attention"}


def architecture_name(hf_config: Any) -> str:
    """The config's architecture (its first ``architectures`` entry, else by ``model_type``)."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    return architecture_of(hf_config)


def _value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def mtp_count_key(hf_config: Any) -> str | None:
    """The config key counting the family's MTP modules (its registry record's), or None for a family without."""
    record = registry.family(architecture_name(hf_config))
    return record.mtp_count_key if record is not None else None


def mtp_layer_count(hf_config: Any) -> int:
    """Number of MTP modules the checkpoint declares (Qwen3-Next/Qwen3.5: ``mtp_num_hidden_layers``;
    Nemotron-H: ``num_nextn_predict_layers``); 0 if none or family without MTP."""
    key = mtp_count_key(hf_config)
    if key is None:
        return 0
    for config in (hf_config, _value(hf_config, "text_config")):
        value = _value(config, key) if config is not None else None
        if value:
            return int(value)
    return 0


def nemotron_h_mtp_block_kinds(config: Any) -> list[str]:
    """The block kinds of one Nemotron-H MTP module (transformers' names); ValueError on a kind the head
    does not build."""
    kinds = _value(config, "mtp_layers_block_type")
    if not kinds:
        pattern = _value(config, "mtp_hybrid_override_pattern") or ""
        kinds = [NEMOTRON_PATTERN.get(c, c) for c in pattern]
    kinds = [NEMOTRON_ALIASES.get(k, k) for k in kinds]
    bad = [k for k in kinds if k not in NEMOTRON_H_MTP_KINDS]
    if not kinds or bad:
        raise ValueError(f"Nemotron-H MTP block kinds {kinds or '(none)'} are not supported; an MTP module's "
                         f"blocks may be {', '.join(NEMOTRON_H_MTP_KINDS)} (mtp_layers_block_type)")
    return kinds


def mtp_attention_layer_count(hf_config: Any) -> int:
    """Attention layers (cache layers) of all the checkpoint's MTP modules: one per Qwen module, one per
    attention block of each Nemotron-H module."""
    count = mtp_layer_count(hf_config)
    if count and mtp_count_key(hf_config) == NEMOTRON_H_MTP_COUNT_KEY:
        return count * nemotron_h_mtp_block_kinds(hf_config).count("full_attention")
    return count
