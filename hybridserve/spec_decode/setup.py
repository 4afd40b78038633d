"""An engine's speculative decoding, set up: the drafter's model and cache layers, the speculator, the
captured verification steps and the batch limit (what ``LLMEngine.__init__`` calls, in that order)."""

from __future__ import annotations

import logging

import torch

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.engine.cpu_fast_paths import attach_captured_decode, attach_captured_steps, prepare_model
from hybridserve.models.mtp import MTPHead, build_mtp_head
from hybridserve.spec_decode.batch_limit import choose_batch_limit
from hybridserve.spec_decode.config import SpeculativeConfig
from hybridserve.spec_decode.draft_model import DraftModel
from hybridserve.spec_decode.mtp import MTPDrafter
from hybridserve.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


def load_drafter(spec: SpeculativeConfig, config, hf_config, model, specs: list[LayerCacheSpec], dtypes,
                 device: torch.device) -> tuple[DraftModel | None, MTPHead | None, list[LayerCacheSpec]]:
    """The draft model or MTP head ``spec`` asks for (prepared for the CPU kernels on the CPU), and the cache
    layers it adds after the target's ``specs``; (None, None, []) for n-gram drafting."""
    if spec.method == "draft_model":
        assert spec.model is not None  # (parse_speculative_config requires it for this method)
        draft = DraftModel(spec.model, hf_config, config, specs, device)
        if device.type == "cpu":
            draft.fast_paths = prepare_model(draft.model, config)
        return draft, None, draft.specs
    if spec.method == "mtp":
        head = build_mtp_head(config.model, hf_config, model, dtypes.model, CacheDtypes.from_resolved(dtypes), device,
                              max(s.index for s in specs) + 1)
        if device.type == "cpu":
            prepare_model(head, config)
        return None, head, head.cache_specs()
    return None, None, []


def make_speculator(spec: SpeculativeConfig, config, cache, pool, device: torch.device, max_model_len: int,
                    draft: DraftModel | None, head: MTPHead | None, generator: torch.Generator) -> Speculator:
    """The engine's :class:`Speculator` over its cache, with the drafter bound to the pool."""
    if draft is not None:
        draft.bind(pool, device)
    mtp = MTPDrafter(head, cache, spec.num_speculative_tokens) if head is not None else None
    return Speculator(spec, cache, max_model_len, config.max_num_batched_tokens, draft, generator, mtp)


def capture_speculation(speculator: Speculator, runner, model, pool, config, max_model_len: int, fast_paths) -> None:
    """Capture the target's verification steps (and the draft model's decode and rerun steps) where the
    decode is captured, then choose the batch limit (``disable_by_batch_size``, timed when "auto")."""
    spec = speculator.config
    rows, tokens = min(config.max_num_seqs, spec.max_batch_size), spec.num_speculative_tokens + 1
    if fast_paths is not None:
        attach_captured_steps(runner, model, pool, max_model_len, fast_paths, rows, tokens)
        draft = speculator.draft_model
        if draft is not None:  # its own decode and rerun steps, over its view of the pool
            attach_captured_decode(draft.runner, draft.model, pool, config, max_model_len, draft.fast_paths)
            attach_captured_steps(draft.runner, draft.model, pool, max_model_len, draft.fast_paths, rows, tokens)
            if draft.fast_paths.off():
                logger.warning("draft model CPU fast paths off: %s", "; ".join(draft.fast_paths.off()))
    speculator.batch_limit = spec.disable_by_batch_size or choose_batch_limit(runner, spec)
