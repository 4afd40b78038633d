"""One rank's model, cache pool, runner and CPU fast paths, built the same way on every rank.

Rank 0 (``LLMEngine``) and the tensor-parallel ranks (``distributed/worker.py``) both build a
:class:`Worker`: the model (or its shard), its fast paths, the cache pool (with room for a drafter's
layers on every rank, so that all pools share one layout) and the runner. Only rank 0 loads the drafter
itself and wraps its model for the ranks (``distributed/driver.py``), which it passes in as the runner's
front.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridserve.cache.layout import compute_layout
from hybridserve.cache.pool import CachePool
from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.config import FP8_KV_DTYPES, EngineConfig, ResolvedDtypes
from hybridserve.engine.cpu_fast_paths import attach_captured_decode, prepare_model
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.models.loader import build_model
from hybridserve.planning.planner import DEFAULT_MAX_MODEL_LEN, drafter_specs
from hybridserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from hybridserve.spec_decode.setup import load_drafter


class Worker:
    """Builds one rank's model, fast paths, pool and runner (see the module docstring).

    ``load_drafter``: rank 0 loads the draft model or MTP head the speculative config names
    (``draft_model``/``mtp_head``); the other ranks only leave room for its cache layers.
    """

    def __init__(self, config: EngineConfig, hf_config: Any, dtypes: ResolvedDtypes, device: torch.device,
                 tp_group: Any = None, load_drafter: bool = True) -> None:
        assert config.model is not None, "a validated config names its checkpoint"
        self.config, self.device = config, device
        keep_fp8 = device.type == "cpu" and config.cpu_kernels and config.quantization != "none"
        self.model = build_model(config.model, hf_config, dtypes.model, CacheDtypes.from_resolved(dtypes), device,
                                 keep_fp8, tp_group=tp_group)
        self.specs: list[LayerCacheSpec] = self.model.cache_specs()
        self.cpu_fast_paths = prepare_model(self.model, config) if device.type == "cpu" else None
        self.spec_config: SpeculativeConfig | None = parse_speculative_config(config.speculative_config)
        self.draft_model, self.mtp_head, draft_specs = self._drafter(hf_config, dtypes, load_drafter)
        self.layout_specs = self.specs + draft_specs  # the target's layers, then a drafter's (draft model, MTP)
        self.layout = compute_layout(self.layout_specs, config.block_size)
        cache_memory: Any = config.cache_memory  # bytes: the config parsed its size when it was validated
        self.pool = CachePool(self.layout, cache_memory, device)
        apply_kv_scales(self.model, self.pool, dtypes.kv_cache)
        if self.draft_model is not None:
            apply_kv_scales(self.draft_model.model, self.pool, dtypes.kv_cache, self.draft_model.offset)
        self.max_model_len = config.max_model_len or default_max_model_len(hf_config)
        self.runner: ModelRunner | None = None

    def _drafter(self, hf_config: Any, dtypes: ResolvedDtypes, load: bool) -> tuple[Any, Any, list[LayerCacheSpec]]:
        """(draft model, MTP head, their cache layers); without ``load``, only the layers of one."""
        spec = self.spec_config
        if spec is None:
            return None, None, []
        if load:
            return load_drafter(spec, self.config, hf_config, self.model, self.specs, dtypes, self.device)
        if spec.method not in ("draft_model", "mtp"):
            return None, None, []
        return None, None, drafter_specs(hf_config, self.specs, spec, self.config)

    @property
    def cpu_kernels(self) -> bool:
        """Whether the compiled CPU kernels run this model."""
        return self.cpu_fast_paths is not None and self.cpu_fast_paths.kernels

    def make_runner(self, front: Any = None) -> ModelRunner:
        """The runner over ``front`` (rank 0's driver of the ranks) or, by default, the model itself."""
        self.runner = ModelRunner(front if front is not None else self.model, self.pool, self.device)
        return self.runner

    def capture_decode(self) -> None:
        """Capture the decode steps into the runner where they can be (RoPE tables first, with the kernels)."""
        if self.cpu_fast_paths is not None:
            attach_captured_decode(self.runner, self.model, self.pool, self.config, self.max_model_len,
                                   self.cpu_fast_paths, eager_reason=tensor_parallel_reason(self.config))


def tensor_parallel_reason(config: EngineConfig) -> str | None:
    """Why decode steps run eagerly under tensor parallelism (a captured step cannot all-reduce); None at size 1."""
    size = config.tensor_parallel_size
    return f"tensor parallel (tensor_parallel_size={size}): a step all-reduces across ranks" if size > 1 else None


def apply_kv_scales(model: torch.nn.Module, pool: CachePool, kv_dtype: torch.dtype, offset: int = 0) -> None:
    """Give each layer's fp8 K/V views the checkpoint's scales (attention modules' ``k_scale``/``v_scale``,
    set by the loader; 1.0 when the checkpoint has none). Other KV dtypes store values unscaled."""
    if kv_dtype not in FP8_KV_DTYPES:
        return
    for module in model.modules():
        spec = getattr(module, "spec", None)
        if isinstance(spec, LayerCacheSpec) and spec.attention is not None:
            cache = pool.layer_caches[spec.index + offset]  # offset: a draft model's layers follow the target's
            cache.k_scale = float(getattr(module, "k_scale", 1.0))
            cache.v_scale = float(getattr(module, "v_scale", 1.0))


def default_max_model_len(hf_config: Any) -> int:
    """``max_model_len`` when none is given: the checkpoint's ``max_position_embeddings``, capped at 4096."""
    value = getattr(hf_config, "max_position_embeddings", None)
    return int(min(value, DEFAULT_MAX_MODEL_LEN)) if value else DEFAULT_MAX_MODEL_LEN
