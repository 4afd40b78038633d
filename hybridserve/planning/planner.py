"""Plan the cache of a model from its config.json alone: no weights and no tokenizer.

A plan's specs are the engine's own: the config is read through transformers' config class (so every key the
file leaves out takes that class's default, derived values included), the model class is built on the ``meta``
device (no memory, no weights) and each layer declares its cache with its mixer's function in
``layers/state_shapes.py``, as the engine's model does after loading. The layout comes from
:func:`~hybridserve.cache.layout.compute_layout` and the capacity from :mod:`hybridserve.cache.capacity`, the
functions the engine's pool allocates with. So a plan's figures are the engine's real ones, for models that
have not been downloaded.

The options come as an :class:`~hybridserve.config.EngineConfig` (torch dtypes) or a
:class:`~hybridserve.planning.plan_config.PlanConfig` (dtype names; what ``hybridserve plan`` uses).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from hybridserve.cache.capacity import (
    bytes_per_sequence,
    ideal_bytes_per_sequence,
    max_sequences,
    pool_geometry,
)
from hybridserve.cache.layout import PoolLayout, compute_layout
from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.models.registry import architecture_of
from hybridserve.spec_decode.config import parse_speculative_config

DTYPE_OPTIONS = ("dtype", "kv_cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype")
#: max_model_len when none is given: the model's max positions, capped here (the planner and the engine alike)
DEFAULT_MAX_MODEL_LEN = 4096

#: the main alternatives every plan is compared with: (label, dtype options; the rest auto)
ALTERNATIVES: tuple[tuple[str, dict[str, str]], ...] = (
    ("all auto", {}),
    ("fp32 state", {"mamba_ssm_cache_dtype": "float32"}),
    ("fp8 KV, fp32 state", {"kv_cache_dtype": "fp8_e4m3", "mamba_ssm_cache_dtype": "float32"}),
    # the most sequences a pool holds: 8-bit temporal and conv state (docs/state_precision.md gives their drift)
    ("int8 state", {"mamba_cache_dtype": "int8", "mamba_ssm_cache_dtype": "int8"}),
)


def load_config(path: str) -> Any:
    """The config of a checkpoint directory, or of a config.json file (read alone), through transformers'
    config class (``models.loader.load_hf_config``; a vision-language config as its served ``text_config``)."""
    from hybridserve.models.loader import load_hf_config

    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    return load_hf_config(path, check_memory=False)  # a plan may be for a bigger machine


def cache_specs_from_config(hf_config: Any, dtypes: Any, tensor_parallel_size: int = 1) -> list[LayerCacheSpec]:
    """Every layer's cache spec, from the model class built on the meta device (no weights): each layer's own
    declaration. ``dtypes``: resolved dtypes (torch dtypes or names). With
    ``tensor_parallel_size`` > 1, one rank's specs, from the model sharded as the engine shards it (every rank's
    are the same); ``hf_config`` must then be transformers' (``models.loader.load_hf_config``)."""
    import torch

    from hybridserve.models.registry import model_class

    architecture = architecture_of(hf_config)
    with torch.device("meta"):
        model = model_class(architecture)(hf_config, CacheDtypes.from_resolved(dtypes))
    if tensor_parallel_size > 1:
        from hybridserve.distributed.sharding import RankGeometry, check_supported, shard_model

        check_supported(architecture, tensor_parallel_size)
        shard_model(model, architecture, RankGeometry(0, tensor_parallel_size))
    return model.cache_specs()


def max_positions(config: Any) -> int | None:
    """The most positions the model was trained for: its config's ``max_position_embeddings`` (the config
    class's default where the file leaves it out), or None for a family without such a bound (Mamba)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def default_max_model_len(config: Any) -> int:
    """The engine's ``max_model_len`` when none is given: the model's max positions, capped at 4096."""
    positions = max_positions(config)
    return min(positions, DEFAULT_MAX_MODEL_LEN) if positions else DEFAULT_MAX_MODEL_LEN


def positions_warning(config: Any, max_model_len: int, option: str = "max_model_len") -> str | None:
    """One line saying that ``max_model_len`` (given as ``option``) runs past the positions the model was
    trained for, or None."""
    positions = max_positions(config)
    if positions is None or max_model_len <= positions:
        return None
    return (f"warning: {option}={max_model_len} exceeds the model's max_position_embeddings={positions}: "
            "positions past it were never trained and may give poor output")


@dataclass(frozen=True)
class CachePlan:
    """One configuration's cache: its specs, layout and capacity in a byte budget."""

    label: str
    architecture: str
    options: dict[str, str]  # the four dtype options as given ("auto" where not)
    dtypes: Any  # config.ResolvedDtypes (torch dtypes) or plan_config.ResolvedDtypeNames
    specs: tuple[LayerCacheSpec, ...]
    layout: PoolLayout
    cache_memory_bytes: int
    max_model_len: int
    prefix_caching: bool = True
    snapshot_interval: int = 0  # tokens between the state snapshots of a long prefill (0: none periodic)
    speculation: Any = None  # spec_decode.config.SpeculativeConfig, or None
    num_drafter_layers: int = 0  # cache layers of a draft model or MTP head, after the target's in ``specs``
    tensor_parallel_size: int = 1  # > 1: ``specs``, the layout and every figure are one rank's (each rank alike)


    @property
    def max_concurrent_sequences(self) -> int:
        """Sequences of ``max_model_len`` tokens that fit in the pool at once (the engine's arithmetic)."""
        return max_sequences(self.layout, self.cache_memory_bytes, self.max_model_len)

    @property
    def bytes_per_sequence(self) -> int:
        """Pool bytes one ``max_model_len`` sequence holds: its state slot and its KV pages."""
        return bytes_per_sequence(self.layout, self.max_model_len)

    @property
    def ideal_bytes_per_sequence(self) -> int:
        """Exact state bytes plus exact KV bytes of ``max_model_len`` tokens: nothing else."""
        return ideal_bytes_per_sequence(self.layout, self.max_model_len)

    @property
    def ideal_max_sequences(self) -> float:
        """The budget divided by the ideal bytes per sequence (no layout can hold more)."""
        ideal = self.ideal_bytes_per_sequence
        return self.cache_memory_bytes / ideal if ideal else float("inf")

    def snapshot_cost(self) -> dict[str, Any]:
        """What prefix caching's state snapshots cost: one state slot each, the KV of how many tokens that is,
        and the snapshots a ``max_model_len`` prefill takes (periodic ones and the prompt's end)."""
        layout = self.layout
        has_state = layout.has_state and self.prefix_caching
        per_snapshot = layout.slot_bytes if has_state else 0
        kv = layout.kv_bytes_per_token
        count = 0
        if has_state:
            count = 1 + ((self.max_model_len - 1) // self.snapshot_interval if self.snapshot_interval else 0)
        return {"prefix_caching": self.prefix_caching, "prefix_snapshot_interval": self.snapshot_interval,
                "snapshot_bytes": per_snapshot,
                "snapshot_kv_token_equivalent": per_snapshot / kv if kv and per_snapshot else None,
                "snapshots_per_max_len_prefill": count,
                "snapshot_bytes_per_max_len_prefill": count * per_snapshot}

    def summary(self) -> dict[str, Any]:
        """The plan's figures (everything but the per-layer table)."""
        layout = self.layout
        geometry = pool_geometry(layout, self.cache_memory_bytes)
        return {
            "label": self.label,
            "options": dict(self.options),
            **self.dtypes.as_names(),
            "attention_block_size": layout.block_size,
            "state_bytes_per_sequence": layout.state_bytes_per_sequence,
            "kv_bytes_per_token": layout.kv_bytes_per_token,
            "page_bytes": layout.page_bytes,
            "slot_bytes": layout.slot_bytes,
            "cache_memory_bytes": self.cache_memory_bytes,
            "pool_bytes": geometry.num_bytes,
            "num_pages": geometry.num_pages,
            "num_slots": geometry.num_slots,
            "max_model_len": self.max_model_len,
            "bytes_per_sequence": self.bytes_per_sequence,
            "ideal_bytes_per_sequence": self.ideal_bytes_per_sequence,
            "max_concurrent_sequences": self.max_concurrent_sequences,
            "ideal_max_sequences": self.ideal_max_sequences,
            **self.snapshot_cost(),
            **self.speculation_cost(),
            "tensor_parallel_size": self.tensor_parallel_size,
            "all_ranks_pool_bytes": geometry.num_bytes * self.tensor_parallel_size,
        }

    def speculation_cost(self) -> dict[str, Any]:
        """What speculative decoding adds: the drafter's layers (already in the page and slot bytes above) and
        the second state slot each drafting sequence verifies on (taken from free room only: reclaimed before
        any request would wait or be preempted for it)."""
        return {"speculation": speculation_summary(self.speculation, self.layout, self.num_drafter_layers)}

    def to_dict(self) -> dict[str, Any]:
        """``summary()`` plus ``architecture`` and ``layers`` (the same entries as ``LLM.cache_layout()``)."""
        return {"architecture": self.architecture, **self.summary(),
                "layers": [spec.describe() for spec in self.specs]}


def plan_cache(hf_config: Any, config: Any, max_model_len: int | None = None,
               label: str = "requested") -> CachePlan:
    """Plan the cache of ``hf_config`` under ``config``'s dtype options, block size and cache memory.

    ``config``: an ``EngineConfig`` or a ``PlanConfig``. ``max_model_len``: defaults to
    ``config.max_model_len``, else the engine's default for the model.
    """
    dtypes = config.resolve_dtypes(hf_config)
    specs = cache_specs_from_config(hf_config, dtypes, getattr(config, "tensor_parallel_size", 1))
    speculation = parse_speculative_config(getattr(config, "speculative_config", None))
    drafter = drafter_specs(hf_config, specs, speculation, config) if speculation is not None else []
    specs = specs + drafter
    layout = compute_layout(specs, config.block_size)
    length = max_model_len or config.max_model_len or default_max_model_len(hf_config)
    options = {name: getattr(config, name) for name in DTYPE_OPTIONS}
    return CachePlan(label, architecture_of(hf_config), options, dtypes, tuple(specs), layout,
                     int(config.cache_memory), int(length), config.enable_prefix_caching,
                     config.prefix_snapshot_interval, speculation, len(drafter),
                     getattr(config, "tensor_parallel_size", 1))


def speculation_summary(speculation: Any, layout: PoolLayout, num_drafter_layers: int) -> dict[str, Any] | None:
    """The speculation figures of a plan and of ``LLM.cache_layout()`` (None without speculation)."""
    if speculation is None:
        return None
    slot = layout.slot_bytes if layout.has_state else 0
    return {"method": speculation.method, "num_speculative_tokens": speculation.num_speculative_tokens,
            "drafter_cache_layers": num_drafter_layers, "verification_slot_bytes": slot,
            "verification_slots_bytes_at_most": slot * speculation.max_batch_size}


def drafter_specs(hf_config: Any, specs: list[LayerCacheSpec], speculation: Any, config: Any) -> list[LayerCacheSpec]:
    """The cache layers a speculative drafter adds after the target's ``specs``, as the engine lays them out:
    a draft model's own (its config read from its directory, its dtypes resolved as the target's options
    say), or the MTP head's attention layers (the target's full-attention KV shape, whole: under tensor
    parallelism rank 0 runs the head unsharded); none for n-gram."""
    offset = max((s.index for s in specs), default=-1) + 1
    if speculation.method == "draft_model":
        draft_config = load_config(speculation.model)
        draft = cache_specs_from_config(draft_config, config.resolve_dtypes(draft_config))
        return [dataclasses.replace(s, index=s.index + offset) for s in draft]
    if speculation.method == "mtp":
        from hybridserve.models.mtp_config import mtp_attention_layer_count

        if getattr(config, "tensor_parallel_size", 1) > 1:  # ``specs`` are one rank's shard: the whole ones
            specs = cache_specs_from_config(hf_config, config.resolve_dtypes(hf_config))
        attention = next((s.attention for s in specs if s.attention is not None and not s.attention.sliding_window),
                         None)
        count = mtp_attention_layer_count(hf_config)
        if attention is None or count == 0:
            raise ValueError(f"{architecture_of(hf_config)} declares no MTP layers to plan for")
        return [LayerCacheSpec(offset + i, "attention", attention) for i in range(count)]
    return []


def plan_alternatives(hf_config: Any, config: Any, max_model_len: int | None = None) -> list[CachePlan]:
    """The plans of :data:`ALTERNATIVES` (``config`` with those dtype options, the rest as given)."""
    plans = []
    for label, options in ALTERNATIVES:
        alt = dataclasses.replace(config, **{**{name: "auto" for name in DTYPE_OPTIONS}, **options})
        plans.append(plan_cache(hf_config, alt, max_model_len, label))
    return plans
