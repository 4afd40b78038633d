"""One request's tokens, cache holdings and progress."""

from __future__ import annotations

import enum
from collections.abc import Collection, Hashable

import torch

from hybridserve.engine.detokenizer import IncrementalDecoder
from hybridserve.outputs import PositionLogprobs
from hybridserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request being generated: prompt, output so far, and what it holds in the cache pool."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int, prompt: str | None = None, eos_token_ids: Collection[int] = (),
                 index: int = 0, origin: Hashable | None = None) -> None:
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is (0 for n == 1)
        # whose submission this is (engine/fair_share.py): the sequences of one add_requests call share it
        self.origin: Hashable = origin if origin is not None else request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival = arrival
        self.eos_token_ids = frozenset(eos_token_ids)  # every id that ends it (unless params.ignore_eos)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV / state is in the cache
        self.block_table: list[int] = []
        self.window_table: list[int] = []  # window page group's pages (-1: released behind the window)
        self.state_slot: int | None = None
        self.spec_slot: int | None = None  # speculative decoding: the slot a verification runs on
        self.spec = None  # speculative decoding: this sequence's drafting state (spec_decode.speculator)
        self.num_cached_tokens: int | None = None  # prompt tokens resumed from the prefix cache at admission
        self.prefix_cache = None  # its prefix-cache answer at first admission (cache.prefix_reason.PrefixCacheInfo)
        self.snapshot_plan: list[int] = []  # positions where the prefix cache snapshots its state
        self.prefix_node = None  # the prefix index node of its last indexed page (prefix caching)
        self.num_indexed_pages = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_logprobs: list[PositionLogprobs] = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[PositionLogprobs | None] = [None] if params.prompt_logprobs is not None else []
        self.output_text = ""  # the text of output_token_ids[:decoder's count] (see OutputProcessor.sync_text)
        self.decoder: IncrementalDecoder | None = None  # the output's incremental detokenizer (made at its first sync)
        self.text_final = False  # output_text is the finished output's text (no more syncs)
        self.num_preemptions = 0
        self.num_step_failures = 0  # failed steps this sequence was part of (see LLMEngine.step)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, count: int) -> list[int]:
        """``all_token_ids[start:start + count]`` without building the whole list."""
        plen = len(self.prompt_token_ids)
        if start >= plen:
            return self.output_token_ids[start - plen:start - plen + count]
        if start + count <= plen:
            return self.prompt_token_ids[start:start + count]
        return self.prompt_token_ids[start:] + self.output_token_ids[:start + count - plen]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet run through the model."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
