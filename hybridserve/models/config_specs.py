"""Cache specs straight from a config.json, without torch or transformers (for ``hybridserve plan``).

The engine gets its specs from the model it builds (each layer declares its own); building one needs
torch, and reading the config needs transformers' config classes, which import torch too: seconds of
imports. Here each supported family maps a config.json to the same specs with plain arithmetic:
the family's defaults for keys the file leaves out (transformers' config class defaults: a file saved
by ``save_pretrained`` omits every key at its default) and the same shapes the model's layers
declare. ``tests/test_plan_cmd.py`` checks every family against the model built on the meta device,
for the test checkpoints and for each config class's defaults.

Families without an entry here are planned the engine's way (:func:`hybridserve.cache.planner.
cache_specs_from_config`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.models.registry import SERVED_AS_TEXT

#: HF ``model_type`` -> the architecture the model registry knows it by
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "jamba": "JambaForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "xlstm": "xLSTMForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}


class JsonConfig:
    """A config.json's keys as attributes (``dtype``, ``architectures``, ...); a missing key is None."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only for keys the file does not have
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_config(path: str) -> JsonConfig:
    """config.json of a checkpoint directory (or the file itself) as a :class:`JsonConfig`."""
    file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if os.path.isdir(path) and not os.path.isfile(file):
        raise ValueError(f"model={path!r} has no config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model={path!r} is not a directory holding a checkpoint")
    try:
        with open(file, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file!r} is not a readable JSON config: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file!r} holds {type(values).__name__}, not a JSON object")
    return JsonConfig(_served_as_text(values))


def _served_as_text(values: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config served as text (``registry.SERVED_AS_TEXT``): its ``text_config`` naming the
    architecture, with the top-level ``tie_word_embeddings`` and dtype (``loader.served_text_config``, without
    transformers). Any other config unchanged."""
    archs = values.get("architectures") or [ARCHITECTURE_OF_MODEL_TYPE.get(values.get("model_type"))]
    text = values.get("text_config") or {}
    if archs[0] not in SERVED_AS_TEXT or not isinstance(text, dict):
        return values
    served = {**text, "architectures": list(archs), "tie_word_embeddings": bool(values.get("tie_word_embeddings"))}
    for key in ("dtype", "torch_dtype"):
        if values.get(key) is not None:
            served[key] = values[key]
    return served


def architecture_of(config: Any) -> str:
    """The config's architecture: ``architectures[0]``, else the one its ``model_type`` maps to."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError("config.json names no architecture ('architectures' is empty) and no model_type; "
                         f"allowed model_types: {', '.join(sorted(ARCHITECTURE_OF_MODEL_TYPE))}")
    if model_type not in ARCHITECTURE_OF_MODEL_TYPE:
        raise ValueError(f"config.json names no architecture and model_type={model_type!r} is not supported; "
                         f"allowed model_types: {', '.join(sorted(ARCHITECTURE_OF_MODEL_TYPE))}")
    return ARCHITECTURE_OF_MODEL_TYPE[model_type]


class _Keys:
    """A family's view of a config: the file's value, else the family's default."""

    def __init__(self, config: Any, defaults: dict[str, Any]) -> None:
        self.config, self.defaults = config, defaults

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.config, name, None)
        return self.defaults.get(name) if value is None else value

    def first(self, *names: str) -> Any:
        """The value of the first of ``names`` the file sets, else the default of the first one."""
        for name in names:
            value = getattr(self.config, name, None)
            if value is not None:
                return value
        return self.defaults.get(names[0])

    def head_dim(self) -> int:
        return self.head_dim_key or self.hidden_size // self.num_attention_heads

    @property
    def head_dim_key(self) -> Any:
        return self.__getattr__("head_dim")

    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads


def _attention(index: int, num_kv_heads: int, head_dim: int, dtypes: CacheDtypes,
               sliding_window: int | None = None) -> LayerCacheSpec:
    return LayerCacheSpec(index, "sliding_attention" if sliding_window else "attention",
                          attention=dtypes.attention(int(num_kv_heads), int(head_dim), sliding_window))


def _mamba2(index: int, *, intermediate: int, n_groups: int, d_state: int, conv_kernel: int, num_heads: int,
            head_dim: int, dtypes: CacheDtypes) -> LayerCacheSpec:
    """``layers/mamba2.py``: conv (intermediate + 2 * groups * state, kernel - 1), ssm (heads, head_dim, state)."""
    conv_dim = int(intermediate) + 2 * int(n_groups) * int(d_state)
    return LayerCacheSpec(index, "mamba2", state=(
        dtypes.conv_state("conv", (conv_dim, int(conv_kernel) - 1)),
        dtypes.temporal_state("ssm", (int(num_heads), int(head_dim), int(d_state)))))


def _mamba1(index: int, *, intermediate: int, d_state: int, conv_kernel: int, dtypes: CacheDtypes) -> LayerCacheSpec:
    """``layers/mamba1.py``: conv (intermediate, kernel - 1), ssm (intermediate, state)."""
    return LayerCacheSpec(index, "mamba", state=(
        dtypes.conv_state("conv", (int(intermediate), int(conv_kernel) - 1)),
        dtypes.temporal_state("ssm", (int(intermediate), int(d_state)))))


def _layer_kinds(k: _Keys, *names: str) -> list[str]:
    kinds = k.first(*names)
    if not isinstance(kinds, list):
        raise ValueError(f"config.json: {names[0]} must be a list of layer kinds, not {kinds!r}")
    return kinds


# ------------------------------------------------------------------------------------------ families
def _llama(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32})
    return [_attention(i, k.kv_heads(), k.head_dim(), dtypes) for i in range(k.num_hidden_layers)]


def _mamba(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 768, "num_hidden_layers": 32, "state_size": 16, "conv_kernel": 4, "expand": 2})
    intermediate = k.intermediate_size or int(k.expand * k.hidden_size)
    return [_mamba1(i, intermediate=intermediate, d_state=k.state_size, conv_kernel=k.conv_kernel, dtypes=dtypes)
            for i in range(k.num_hidden_layers)]


def _mamba2_family(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 64, "num_heads": 128, "head_dim": 64,
                  "state_size": 128, "conv_kernel": 4, "n_groups": 8, "expand": 2})
    return [_mamba2(i, intermediate=int(k.expand * k.hidden_size), n_groups=k.n_groups, d_state=k.state_size,
                    conv_kernel=k.conv_kernel, num_heads=k.num_heads, head_dim=k.head_dim_key, dtypes=dtypes)
            for i in range(k.num_hidden_layers)]


_BAMBA_MAMBA = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2}


def _bamba_style_mamba(k: _Keys, index: int, dtypes: CacheDtypes) -> LayerCacheSpec:
    """Bamba / Granite-4.0-H ``mamba_*`` keys (``mamba_d_head`` "auto": expand * hidden / heads)."""
    intermediate = int(k.mamba_expand * k.hidden_size)
    d_head = k.mamba_d_head
    if d_head in (None, "auto"):
        d_head = int(k.mamba_expand * k.hidden_size) // k.mamba_n_heads
    return _mamba2(index, intermediate=intermediate, n_groups=k.mamba_n_groups, d_state=k.mamba_d_state,
                   conv_kernel=k.mamba_d_conv, num_heads=k.mamba_n_heads, head_dim=d_head, dtypes=dtypes)


def _bamba(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  **_BAMBA_MAMBA})
    attn = set(k.attn_layer_indices or [])
    return [_attention(i, k.kv_heads(), k.head_dim(), dtypes) if i in attn else _bamba_style_mamba(k, i, dtypes)
            for i in range(k.num_hidden_layers)]


def _granitemoehybrid(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, **_BAMBA_MAMBA})
    kinds = k.first("layer_types", "layers_block_type") or ["linear_attention"] * k.num_hidden_layers
    return [_bamba_style_mamba(k, i, dtypes) if kind in ("linear_attention", "mamba")
            else _attention(i, k.kv_heads(), k.head_dim(), dtypes) for i, kind in enumerate(kinds)]


def _jamba(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
                  "mamba_expand": 2})
    return [_attention(i, k.kv_heads(), k.hidden_size // k.num_attention_heads, dtypes)
            if i % k.attn_layer_period == k.attn_layer_offset else
            _mamba1(i, intermediate=int(k.mamba_expand * k.hidden_size), d_state=k.mamba_d_state,
                    conv_kernel=k.mamba_d_conv, dtypes=dtypes)
            for i in range(k.num_hidden_layers)]


NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
NEMOTRON_ALIASES = {"mamba": "linear_attention", "attention": "full_attention"}


def _nemotron_h(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
                  "conv_kernel": 4})
    kinds = k.first("layers_block_type", "layer_types")
    if kinds is None:
        pattern = getattr(c, "hybrid_override_pattern", None)
        kinds = ([NEMOTRON_PATTERN[ch] for ch in pattern] if pattern is not None
                 else ["linear_attention", "moe", "full_attention", "mlp"])
    specs = []
    for i, kind in enumerate(kinds):
        kind = NEMOTRON_ALIASES.get(kind, kind)
        if kind == "linear_attention":
            specs.append(_mamba2(i, intermediate=k.mamba_num_heads * k.mamba_head_dim,
                                 n_groups=k.first("n_groups", "mamba_n_groups"), d_state=k.ssm_state_size,
                                 conv_kernel=k.first("conv_kernel", "mamba_d_conv"), num_heads=k.mamba_num_heads,
                                 head_dim=k.mamba_head_dim, dtypes=dtypes))
        elif kind == "full_attention":
            specs.append(_attention(i, k.kv_heads(), k.head_dim(), dtypes))
        elif kind not in ("mlp", "moe"):
            raise ValueError(f"layer {i}: unknown Nemotron-H layer kind {kind!r}; known: linear_attention, "
                             "full_attention, mlp, moe")
    return specs


def _qwen3_next(c: Any, dtypes: CacheDtypes, defaults: dict[str, Any] | None = None) -> list[LayerCacheSpec]:
    """Qwen3-Next, and Qwen3.5 (the same layers) with its config class's ``defaults``."""
    k = _Keys(c, {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                  "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                  **(defaults or {})})
    kinds = k.layer_types or ["linear_attention" if (i + 1) % 4 else "full_attention"
                              for i in range(k.num_hidden_layers)]
    specs = []
    for i, kind in enumerate(kinds[:k.num_hidden_layers]):
        if kind == "linear_attention":
            key_dim = k.linear_num_key_heads * k.linear_key_head_dim
            conv_dim = 2 * key_dim + k.linear_num_value_heads * k.linear_value_head_dim
            specs.append(LayerCacheSpec(i, "gated_delta_net", state=(
                dtypes.conv_state("conv", (conv_dim, k.linear_conv_kernel_dim - 1)),
                dtypes.temporal_state("recurrent", (k.linear_num_value_heads, k.linear_key_head_dim,
                                                    k.linear_value_head_dim)))))
        else:
            specs.append(_attention(i, k.kv_heads(), k.head_dim(), dtypes))
    return specs


def _minimax(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8})
    kinds = k.layer_types or ["full_attention" if (i + 1) % 2 else "linear_attention"
                              for i in range(k.num_hidden_layers)]
    specs = []
    for i, kind in enumerate(kinds[:k.num_hidden_layers]):
        if kind == "linear_attention":
            heads, dim = k.num_attention_heads, k.head_dim()
            specs.append(LayerCacheSpec(i, "linear_attention", state=(
                dtypes.temporal_state("kv_state", (heads, dim, dim)),)))
        else:
            specs.append(_attention(i, k.kv_heads(), k.head_dim(), dtypes, getattr(c, "sliding_window", None)))
    return specs


def _lfm2(c: Any, dtypes: CacheDtypes, defaults: dict[str, Any]) -> list[LayerCacheSpec]:
    k = _Keys(c, {"num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3, **defaults})
    kinds = k.layer_types
    if kinds is None:
        if "full_attn_idxs" not in defaults:
            raise ValueError("config.json has no layer_types (the kind of each layer)")
        attn = k.full_attn_idxs if k.full_attn_idxs is not None else list(range(k.num_hidden_layers))
        kinds = ["full_attention" if i in attn else "conv" for i in range(k.num_hidden_layers)]
    return [LayerCacheSpec(i, "short_conv", state=(dtypes.conv_state("conv", (k.hidden_size, k.conv_L_cache - 1)),))
            if kind == "conv" else _attention(i, k.kv_heads(), k.head_dim(), dtypes)
            for i, kind in enumerate(kinds[:k.num_hidden_layers])]


def _lfm3(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    """``models/lfm3.py``: LFM2's conv windows; KV per attention layer, a sliding_attention one's windowed."""
    k = _Keys(c, {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4,
                  "head_dim": 128, "conv_L_cache": 7})
    # Lfm3Config's default window is 256; a file may set it to null (no window)
    window = c.to_dict().get("sliding_window", 256) if hasattr(c, "to_dict") else 256
    kinds = k.layer_types or ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0
                              else "conv" for i in range(k.num_hidden_layers)]
    specs = []
    for i, kind in enumerate(kinds[:k.num_hidden_layers]):
        if kind == "conv":
            specs.append(LayerCacheSpec(i, "short_conv", state=(
                dtypes.conv_state("conv", (k.hidden_size, k.conv_L_cache - 1)),)))
        else:
            specs.append(_attention(i, k.kv_heads(), k.head_dim(), dtypes,
                                    window if kind == "sliding_attention" else None))
    return specs


def _joined(attention: LayerCacheSpec, state: LayerCacheSpec) -> LayerCacheSpec:
    """One layer's attention and Mamba2 state under one index (``models/base.py`` merges them so)."""
    return LayerCacheSpec(attention.index, f"{attention.kind}+{state.kind}", attention.attention, state.state)


def _zamba2(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 2560, "num_attention_heads": 32, "n_mamba_heads": 8, "mamba_d_state": 64,
                  "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1})
    kinds = k.layers_block_type or (["linear_attention"] + (["linear_attention"] * 5 + ["hybrid"]) * 7
                                    + ["linear_attention"] * 4 + ["hybrid"] + ["linear_attention"] * 3 + ["hybrid"]
                                    + ["linear_attention"] * 2)
    intermediate = int(k.mamba_expand * k.hidden_size)  # Zamba2Config derives the head sizes, whatever the file says
    head_dim = 2 * k.hidden_size // k.num_attention_heads
    specs = []
    for i, kind in enumerate(kinds):
        if kind not in ("hybrid", "linear_attention", "mamba", "mamba2"):
            raise ValueError(f"Zamba2 layer {i}: unknown layer kind {kind!r}; known: hybrid, linear_attention, "
                             "mamba, mamba2")
        state = _mamba2(i, intermediate=intermediate, n_groups=k.mamba_ngroups, d_state=k.mamba_d_state,
                        conv_kernel=k.mamba_d_conv, num_heads=k.n_mamba_heads,
                        head_dim=intermediate // k.n_mamba_heads, dtypes=dtypes)
        specs.append(_joined(_attention(i, k.kv_heads(), head_dim, dtypes), state) if kind == "hybrid" else state)
    return specs


def _falcon_h1(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
                  "mamba_expand": 2})
    # the class default of mamba_d_ssm is 1024; a file may set it to null (then expand * hidden)
    has_ssm = hasattr(c, "to_dict") and "mamba_d_ssm" in c.to_dict()
    d_ssm = getattr(c, "mamba_d_ssm", None) if has_ssm else 1024
    intermediate = d_ssm if d_ssm is not None else int(k.mamba_expand * k.hidden_size)
    d_head = k.mamba_d_head
    if d_head in (None, "auto"):
        d_head = intermediate // k.mamba_n_heads
    return [_joined(_attention(i, k.kv_heads(), k.head_dim(), dtypes),
                    _mamba2(i, intermediate=intermediate, n_groups=k.mamba_n_groups, d_state=k.mamba_d_state,
                            conv_kernel=k.mamba_d_conv, num_heads=k.mamba_n_heads, head_dim=d_head, dtypes=dtypes))
            for i in range(k.num_hidden_layers)]


def _zamba2_positions(c: Any) -> int:
    return 16384 if getattr(c, "use_long_context", False) else 4096


@dataclass(frozen=True)
class Family:
    """How to read one architecture's cache specs from its config, and its config class's default
    ``max_position_embeddings`` (None: the class has none)."""

    specs: Callable[[Any, CacheDtypes], list[LayerCacheSpec]]
    default_max_positions: int | None = None


def _lfm2_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return _lfm2(c, d, {"hidden_size": 2560, "num_hidden_layers": 32, "full_attn_idxs": None})


def _lfm2_moe_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return _lfm2(c, d, {"hidden_size": 2048, "num_hidden_layers": 32})


def _text_of(c: Any) -> Any:
    """The language model's keys: a vision-language config's ``text_config`` (a transformers object, or a dict
    of a file not read through :func:`read_config`), else the config itself."""
    text = getattr(c, "text_config", None)
    return c if text is None else JsonConfig(text) if isinstance(text, dict) else text


def _qwen3_5_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return _qwen3_next(_text_of(c), d, {"hidden_size": 4096, "num_hidden_layers": 32, "num_key_value_heads": 4})


def _qwen3_5_moe_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return _qwen3_next(_text_of(c), d, {"hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2})


def _olmo_hybrid(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    """OLMo-Hybrid: Qwen3-Next's gated delta net state, with OlmoHybridConfig's derived defaults (linear heads =
    attention heads, key head = int(0.75 hidden / heads), value head = 2 key head; attention every fourth layer,
    else the last)."""
    k = _Keys(c, {"hidden_size": 3840, "num_hidden_layers": 32, "num_attention_heads": 30,
                  "linear_conv_kernel_dim": 4})
    n = k.num_hidden_layers
    kinds = k.layer_types
    if kinds is None:
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in kinds:
            kinds[-1] = "full_attention"
    heads_k = k.linear_num_key_heads or k.num_attention_heads
    key_head = k.linear_key_head_dim or int(0.75 * k.hidden_size / heads_k)
    derived = {"layer_types": kinds, "linear_num_key_heads": heads_k, "linear_key_head_dim": key_head,
               "linear_num_value_heads": k.linear_num_value_heads or k.num_attention_heads,
               "linear_value_head_dim": k.linear_value_head_dim or 2 * key_head,
               "num_key_value_heads": k.num_key_value_heads or k.num_attention_heads,
               "head_dim": k.head_dim_key or k.hidden_size // k.num_attention_heads}
    return _qwen3_next(c, dtypes, {**k.defaults, **derived})


def _xlstm(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    """``layers/mlstm.py``: per block C (heads, qk head, v head), n (heads, qk head), m (heads,); HF's layer
    truncates ``hidden * factor``. xLSTMConfig takes ``embedding_dim`` only for a null hidden_size, and builds
    ``num_blocks`` blocks (else ``num_hidden_layers``)."""
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_heads": 8, "qk_dim_factor": 0.5,
                  "v_dim_factor": 1.0})
    explicit_null = hasattr(c, "to_dict") and "hidden_size" in c.to_dict() and c.to_dict()["hidden_size"] is None
    hidden = c.embedding_dim if explicit_null and c.embedding_dim is not None else k.hidden_size
    blocks = c.num_blocks if c.num_blocks is not None else k.num_hidden_layers
    heads = k.num_heads
    dk, dv = int(hidden * k.qk_dim_factor) // heads, int(hidden * k.v_dim_factor) // heads
    return [LayerCacheSpec(i, "mlstm", state=(dtypes.temporal_state("C", (heads, dk, dv)),
                                              dtypes.temporal_state("n", (heads, dk)),
                                              dtypes.temporal_state("m", (heads,))))
            for i in range(int(blocks))]


def _kimi_linear(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    """``layers/kda.py`` (conv (3 heads * head_dim, kernel - 1), recurrent (heads, head_dim, head_dim)) and
    ``layers/mla.py`` (one latent of kv_lora_rank + qk_rope_head_dim per token). KimiLinearConfig reads
    ``linear_attn_config`` (the published checkpoints' form; its layer lists 1-indexed) where the file sets it."""
    k = _Keys(c, {"num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "linear_head_dim": 128,
                  "linear_num_heads": 32, "linear_conv_kernel_dim": 4})
    lin = getattr(c, "linear_attn_config", None)
    lin = lin if isinstance(lin, dict) else {}
    heads = int(lin.get("num_heads", k.linear_num_heads))
    dim = int(lin.get("head_dim", k.linear_head_dim))
    kernel = int(lin.get("short_conv_kernel_size", k.linear_conv_kernel_dim))
    n = int(k.num_hidden_layers)
    kinds = k.layer_types
    if kinds is None and "full_attn_layers" in lin and "kda_layers" in lin:
        kinds = [None] * n
        for i in lin["full_attn_layers"]:
            kinds[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            kinds[i - 1] = "linear_attention"
    kinds = kinds or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    specs = []
    for i, kind in enumerate(kinds[:n]):
        if kind == "linear_attention":
            specs.append(LayerCacheSpec(i, "kda", state=(dtypes.conv_state("conv", (3 * heads * dim, kernel - 1)),
                                                         dtypes.temporal_state("recurrent", (heads, dim, dim)))))
        else:
            specs.append(LayerCacheSpec(i, "mla", attention=dtypes.latent_attention(int(k.kv_lora_rank),
                                                                                   int(k.qk_rope_head_dim))))
    return specs


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_llama, 2048),
    "MambaForCausalLM": Family(_mamba),
    "FalconMambaForCausalLM": Family(_mamba),
    "Mamba2ForCausalLM": Family(_mamba2_family),
    "BambaForCausalLM": Family(_bamba, 262144),
    "GraniteMoeHybridForCausalLM": Family(_granitemoehybrid, 2048),
    "JambaForCausalLM": Family(_jamba, 262144),
    "NemotronHForCausalLM": Family(_nemotron_h, 4096),
    "Qwen3NextForCausalLM": Family(_qwen3_next, 32768),
    "MiniMaxForCausalLM": Family(_minimax, 131072),
    "Lfm2ForCausalLM": Family(_lfm2_specs, 128000),
    "Lfm2MoeForCausalLM": Family(_lfm2_moe_specs, 128000),
    "Lfm3ForCausalLM": Family(_lfm3, 128000),
    "Zamba2ForCausalLM": Family(_zamba2, 4096),
    "FalconH1ForCausalLM": Family(_falcon_h1, 8192),
    "Qwen3_5ForCausalLM": Family(_qwen3_5_specs, 32768),
    "Qwen3_5MoeForCausalLM": Family(_qwen3_5_moe_specs, 32768),
    "Qwen3_5ForConditionalGeneration": Family(_qwen3_5_specs, 32768),
    "Qwen3_5MoeForConditionalGeneration": Family(_qwen3_5_moe_specs, 32768),
    "OlmoHybridForCausalLM": Family(_olmo_hybrid, 65536),
    "xLSTMForCausalLM": Family(_xlstm),
    "KimiLinearForCausalLM": Family(_kimi_linear, 1048576),
}


def has_family(config: Any) -> bool:
    """Whether ``config``'s architecture is planned here (without torch)."""
    return architecture_of(config) in FAMILIES


def config_cache_specs(config: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    """Every layer's cache spec from ``config`` alone (its family must be in :data:`FAMILIES`)."""
    return FAMILIES[architecture_of(config)].specs(config, dtypes)


def max_positions(config: Any) -> int | None:
    """The most positions the model was trained for: ``max_position_embeddings``, or its config class's
    default when the file leaves it out; None when the family has no such bound (Mamba)."""
    value = getattr(config, "max_position_embeddings", None)
    if architecture_of(config) == "Zamba2ForCausalLM" and getattr(config, "use_long_context", False):
        value = _zamba2_positions(config)  # Zamba2Config sets it so, whatever the file says
    if value is None:
        family = FAMILIES.get(architecture_of(config))
        value = family.default_max_positions if family is not None else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


__all__ = ["ARCHITECTURE_OF_MODEL_TYPE", "FAMILIES", "JsonConfig", "architecture_of", "config_cache_specs",
           "has_family", "max_positions", "read_config"]
