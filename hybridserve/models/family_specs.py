"""Each built-in family's layer kinds and cache specs from its config alone, without torch or transformers.

A family's function decodes which kind each layer is (its config's ``layer_types``, pattern or period, under the
names published checkpoints use) and builds each layer's spec with the mixer's own function
(``layers/state_shapes.py``, which the layers call too), taking the family's config class defaults for keys the
file leaves out (a file saved by ``save_pretrained`` omits every key at its default). The registry
(``models/registry.py``) names each family's function; ``tests/test_plan_cmd.py`` checks each against the model
built on the meta device, for the test checkpoints and for each config class's defaults.
"""

from __future__ import annotations

from typing import Any

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.layers.state_shapes import (
    attention_spec,
    gated_delta_net_spec,
    kda_spec,
    linear_attention_spec,
    mamba1_spec,
    mamba2_spec,
    mla_spec,
    mlstm_spec,
    short_conv_spec,
)


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




# ------------------------------------------------------------------------------------------ families
def llama_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32})
    return [attention_spec(i, dtypes, k.kv_heads(), k.head_dim()) for i in range(k.num_hidden_layers)]


def mamba_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 768, "num_hidden_layers": 32, "state_size": 16, "conv_kernel": 4, "expand": 2})
    intermediate = k.intermediate_size or int(k.expand * k.hidden_size)
    return [mamba1_spec(i, dtypes, intermediate=intermediate, d_state=k.state_size, conv_kernel=k.conv_kernel)
            for i in range(k.num_hidden_layers)]


def mamba2_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 64, "num_heads": 128, "head_dim": 64,
                  "state_size": 128, "conv_kernel": 4, "n_groups": 8, "expand": 2})
    return [mamba2_spec(i, dtypes, intermediate=int(k.expand * k.hidden_size), n_groups=k.n_groups,
                        d_state=k.state_size, conv_kernel=k.conv_kernel, num_heads=k.num_heads, head_dim=k.head_dim_key)
            for i in range(k.num_hidden_layers)]


_BAMBA_MAMBA = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2}


def _bamba_style_mamba(k: _Keys, index: int, dtypes: CacheDtypes) -> LayerCacheSpec:
    """Bamba / Granite-4.0-H ``mamba_*`` keys (``mamba_d_head`` "auto": expand * hidden / heads)."""
    intermediate = int(k.mamba_expand * k.hidden_size)
    d_head = k.mamba_d_head
    if d_head in (None, "auto"):
        d_head = int(k.mamba_expand * k.hidden_size) // k.mamba_n_heads
    return mamba2_spec(index, dtypes, intermediate=intermediate, n_groups=k.mamba_n_groups, d_state=k.mamba_d_state,
                   conv_kernel=k.mamba_d_conv, num_heads=k.mamba_n_heads, head_dim=d_head)


def bamba_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  **_BAMBA_MAMBA})
    attn = set(k.attn_layer_indices or [])
    return [attention_spec(i, dtypes, k.kv_heads(), k.head_dim()) if i in attn else _bamba_style_mamba(k, i, dtypes)
            for i in range(k.num_hidden_layers)]


def granitemoehybrid_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, **_BAMBA_MAMBA})
    kinds = k.first("layer_types", "layers_block_type") or ["linear_attention"] * k.num_hidden_layers
    return [_bamba_style_mamba(k, i, dtypes) if kind in ("linear_attention", "mamba")
            else attention_spec(i, dtypes, k.kv_heads(), k.head_dim()) for i, kind in enumerate(kinds)]


def jamba_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
                  "mamba_expand": 2})
    return [attention_spec(i, dtypes, k.kv_heads(), k.hidden_size // k.num_attention_heads)
            if i % k.attn_layer_period == k.attn_layer_offset else
            mamba1_spec(i, dtypes, intermediate=int(k.mamba_expand * k.hidden_size), d_state=k.mamba_d_state,
                    conv_kernel=k.mamba_d_conv)
            for i in range(k.num_hidden_layers)]


NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
NEMOTRON_ALIASES = {"mamba": "linear_attention", "attention": "full_attention"}


def nemotron_h_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
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
            specs.append(mamba2_spec(i, dtypes, intermediate=k.mamba_num_heads * k.mamba_head_dim,
                                 n_groups=k.first("n_groups", "mamba_n_groups"), d_state=k.ssm_state_size,
                                 conv_kernel=k.first("conv_kernel", "mamba_d_conv"), num_heads=k.mamba_num_heads,
                                 head_dim=k.mamba_head_dim))
        elif kind == "full_attention":
            specs.append(attention_spec(i, dtypes, k.kv_heads(), k.head_dim()))
        elif kind not in ("mlp", "moe"):
            raise ValueError(f"layer {i}: unknown Nemotron-H layer kind {kind!r}; known: linear_attention, "
                             "full_attention, mlp, moe")
    return specs


def qwen3_next_specs(c: Any, dtypes: CacheDtypes, defaults: dict[str, Any] | None = None) -> list[LayerCacheSpec]:
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
            specs.append(gated_delta_net_spec(
                i, dtypes, num_k_heads=k.linear_num_key_heads, num_v_heads=k.linear_num_value_heads,
                head_k_dim=k.linear_key_head_dim, head_v_dim=k.linear_value_head_dim,
                conv_kernel=k.linear_conv_kernel_dim))
        else:
            specs.append(attention_spec(i, dtypes, k.kv_heads(), k.head_dim()))
    return specs


def minimax_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
    k = _Keys(c, {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8})
    kinds = k.layer_types or ["full_attention" if (i + 1) % 2 else "linear_attention"
                              for i in range(k.num_hidden_layers)]
    specs = []
    for i, kind in enumerate(kinds[:k.num_hidden_layers]):
        if kind == "linear_attention":
            heads, dim = k.num_attention_heads, k.head_dim()
            specs.append(linear_attention_spec(i, dtypes, num_heads=heads, head_dim=dim))
        else:
            specs.append(attention_spec(i, dtypes, k.kv_heads(), k.head_dim(), getattr(c, "sliding_window", None)))
    return specs


def lfm2_layers(c: Any, dtypes: CacheDtypes, defaults: dict[str, Any]) -> list[LayerCacheSpec]:
    k = _Keys(c, {"num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3, **defaults})
    kinds = k.layer_types
    if kinds is None:
        if "full_attn_idxs" not in defaults:
            raise ValueError("config.json has no layer_types (the kind of each layer)")
        attn = k.full_attn_idxs if k.full_attn_idxs is not None else list(range(k.num_hidden_layers))
        kinds = ["full_attention" if i in attn else "conv" for i in range(k.num_hidden_layers)]
    return [short_conv_spec(i, dtypes, hidden=k.hidden_size, conv_kernel=k.conv_L_cache)
            if kind == "conv" else attention_spec(i, dtypes, k.kv_heads(), k.head_dim())
            for i, kind in enumerate(kinds[:k.num_hidden_layers])]


def lfm3_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
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
            specs.append(short_conv_spec(i, dtypes, hidden=k.hidden_size, conv_kernel=k.conv_L_cache))
        else:
            specs.append(attention_spec(i, dtypes, k.kv_heads(), k.head_dim(),
                                    window if kind == "sliding_attention" else None))
    return specs


def _joined(attention: LayerCacheSpec, state: LayerCacheSpec) -> LayerCacheSpec:
    """One layer's attention and Mamba2 state under one index (``models/base.py`` merges them so)."""
    return LayerCacheSpec(attention.index, f"{attention.kind}+{state.kind}", attention.attention, state.state)


def zamba2_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
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
        state = mamba2_spec(i, dtypes, intermediate=intermediate, n_groups=k.mamba_ngroups, d_state=k.mamba_d_state,
                        conv_kernel=k.mamba_d_conv, num_heads=k.n_mamba_heads,
                        head_dim=intermediate // k.n_mamba_heads)
        specs.append(_joined(attention_spec(i, dtypes, k.kv_heads(), head_dim), state) if kind == "hybrid" else state)
    return specs


def falcon_h1_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
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
    return [_joined(attention_spec(i, dtypes, k.kv_heads(), k.head_dim()),
                    mamba2_spec(i, dtypes, intermediate=intermediate, n_groups=k.mamba_n_groups,
                                d_state=k.mamba_d_state, conv_kernel=k.mamba_d_conv, num_heads=k.mamba_n_heads,
                                head_dim=d_head))
            for i in range(k.num_hidden_layers)]


def zamba2_positions(c: Any) -> int | None:
    """Zamba2Config sets ``max_position_embeddings`` to 16384 under ``use_long_context``, whatever the file says."""
    return 16384 if getattr(c, "use_long_context", False) else None


def lfm2_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return lfm2_layers(c, d, {"hidden_size": 2560, "num_hidden_layers": 32, "full_attn_idxs": None})


def lfm2_moe_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return lfm2_layers(c, d, {"hidden_size": 2048, "num_hidden_layers": 32})


def _text_of(c: Any) -> Any:
    """The language model's keys: a vision-language config's ``text_config`` (a transformers object, or a dict
    of a file not read through :func:`read_config`), else the config itself."""
    text = getattr(c, "text_config", None)
    return c if text is None else JsonConfig(text) if isinstance(text, dict) else text


def qwen3_5_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return qwen3_next_specs(_text_of(c), d, {"hidden_size": 4096, "num_hidden_layers": 32, "num_key_value_heads": 4})


def qwen3_5_moe_specs(c: Any, d: CacheDtypes) -> list[LayerCacheSpec]:
    return qwen3_next_specs(_text_of(c), d, {"hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2})


def olmo_hybrid_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
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
    return qwen3_next_specs(c, dtypes, {**k.defaults, **derived})


def xlstm_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
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
    return [mlstm_spec(i, dtypes, num_heads=heads, qk_head_dim=dk, v_head_dim=dv)
            for i in range(int(blocks))]


def kimi_linear_specs(c: Any, dtypes: CacheDtypes) -> list[LayerCacheSpec]:
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
            specs.append(kda_spec(i, dtypes, num_heads=heads, head_dim=dim, conv_kernel=kernel))
        else:
            specs.append(mla_spec(i, dtypes, k.kv_lora_rank, k.qk_rope_head_dim))
    return specs

