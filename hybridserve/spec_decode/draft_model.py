"""A draft model: a smaller checkpoint with the target's tokenizer, its KV and state in the target's pool.

Its layers are cache layers of the pool after the target's (indices shifted by ``offset``): each page holds
both models' KV of its tokens and each slot both models' state, so a sequence's one block table and one
state slot serve both, and forks, prefix caching and preemption need nothing of their own. The draft model
reads the pool through its own view (its indices mapped to the shifted layers).

The draft model absorbs what the target absorbs. Every step it runs the scheduled tokens first (prefill
chunks, decodes, reruns after a rejection), each on the slot the target will use; a drafting sequence's
last-token logits give its first draft, and ``m`` more one-token steps give the others and absorb the last.
With every draft accepted both models are past them all on the speculative slot; with one rejected both
still are before them on the state slot.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from hybridserve.cache.pool import CachePool
from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.scheduler import ScheduledSeq
from hybridserve.models.loader import build_model, load_hf_config
from hybridserve.spec_decode.acceptance import draw_drafts

if TYPE_CHECKING:
    from hybridserve.engine.cpu_fast_paths import CpuFastPaths

logger = logging.getLogger(__name__)


class DraftModel:
    """The draft model of one engine: its module, its cache layers in the pool, its runner."""

    def __init__(self, path: str, target_config, config, target_specs: list[LayerCacheSpec],
                 device: torch.device) -> None:
        """Load ``path`` under the engine's dtype options (``config``); ValueError when its vocabulary
        differs from the target's."""
        self.path = path
        self.hf_config = load_hf_config(path)
        target_vocab, vocab = target_config.vocab_size, self.hf_config.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"speculative_config model {path!r} has a vocabulary of {vocab} tokens, the target "
                             f"{target_vocab}: a draft model must share the target's tokenizer")
        self.dtypes = config.resolve_dtypes(self.hf_config)
        self.model = build_model(path, self.hf_config, self.dtypes.model, CacheDtypes.from_resolved(self.dtypes),
                                 device)
        self.offset = max((s.index for s in target_specs), default=-1) + 1
        self.own_specs = self.model.cache_specs()
        self.specs = [dataclasses.replace(s, index=s.index + self.offset) for s in self.own_specs]
        self.runner: ModelRunner | None = None
        self.fast_paths: CpuFastPaths | None = None  # set where it runs on the CPU kernels

    def bind(self, pool: CachePool, device: torch.device) -> ModelRunner:
        """Its runner over ``pool`` (made after the pool, which holds its layers)."""
        caches = {s.index: pool.layer_caches[s.index + self.offset] for s in self.own_specs}
        self.runner = ModelRunner(self.model, pool, device, caches)
        return self.runner

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq], drafting: list[tuple[ScheduledSeq, int]],
             default_generator: torch.Generator) -> None:
        """Run the step's scheduled tokens through the draft model, then draft for each ``(item, room)`` of
        ``drafting`` (its pages and speculative slot granted): ``item.drafts`` gets ``room`` tokens, and
        ``item.draft_probs`` their distributions where the request samples."""
        runner = self.runner
        assert runner is not None, "bind() comes before the first step"
        logits = runner.run(scheduled)
        if not drafting:
            return
        row_of = {id(it): i for i, it in enumerate(logits.sample_seqs)}
        rows = [row_of[id(item)] for item, _ in drafting]
        assert logits.sample_logits is not None  # (every drafting item samples this step)
        current = logits.sample_logits[rows] if len(rows) != len(logits.sample_seqs) else logits.sample_logits
        probs: list[list[torch.Tensor]] = [[] for _ in drafting]
        active = list(range(len(drafting)))  # drafting items still short of their room
        for j in range(max(room for _, room in drafting)):
            tokens, dists = draw_drafts(current, [drafting[i][0].seq for i in active], default_generator)
            for r, p in dists.items():
                probs[active[r]].append(p)
            for i, token in zip(active, tokens):
                drafting[i][0].drafts.append(token)
            # absorb each new draft (the last one too: a fully accepted verification leaves both models past it)
            seqs = [drafting[i][0].seq for i in active]
            positions = [drafting[i][0].seq.num_computed_tokens + j + 1 for i in active]
            current = runner.run_one_token_rows(seqs, tokens, positions)
            keep = [r for r, i in enumerate(active) if drafting[i][1] > j + 1]
            if not keep:
                break
            active = [active[r] for r in keep]
            current = current[keep] if len(keep) != len(seqs) else current
        for (item, _), item_probs in zip(drafting, probs):
            item.draft_probs = torch.stack(item_probs) if item_probs else None
