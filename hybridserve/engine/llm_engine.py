"""The engine: requests in, one batched step at a time, outputs out."""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Any

import torch

from hybridserve.cache.capacity import max_sequences
from hybridserve.cache.kv_events import KVEvent, KVEventRecorder
from hybridserve.cache.manager import CacheManager
from hybridserve.cache.spec import CacheDtypes
from hybridserve.config import EngineConfig, ResolvedDtypes, dtype_name
from hybridserve.distributed.driver import DriverModel
from hybridserve.distributed.group import TensorParallelError
from hybridserve.distributed.launch import Launch, launch
from hybridserve.distributed.sharding import check_shardable
from hybridserve.engine.detokenizer import Detokenizer
from hybridserve.engine.model_runner import StepLogits
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.request_registry import RequestRegistry
from hybridserve.engine.scheduler import ScheduledSeq, Scheduler
from hybridserve.engine.seq_limit import fitted_max_num_seqs
from hybridserve.engine.sequence import Sequence, SequenceStatus
from hybridserve.engine.worker import Worker
from hybridserve.generation_config import generation_eos_ids, load_generation_defaults, token_id_list
from hybridserve.kernels.thread_share import ThreadShare
from hybridserve.kernels.threads import setup_threads
from hybridserve.layers.weight_bytes import weight_bytes
from hybridserve.models.loader import load_hf_config
from hybridserve.outputs import RequestOutput
from hybridserve.planning.planner import positions_warning, speculation_summary
from hybridserve.sampling_params import SamplingParams
from hybridserve.spec_decode.setup import capture_speculation, make_speculator
from hybridserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

#: a sequence in this many failed steps fails (see LLMEngine.step)
MAX_STEP_FAILURES = 3


class LLMEngine:
    """Loads a checkpoint, owns the pool, schedules and runs steps.

    ``add_request`` validates and queues; ``step`` runs one batched forward and returns the
    outputs of the requests it advanced; ``abort_request`` frees a request's cache at once.
    """

    def __init__(self, config: EngineConfig) -> None:
        config = copy.copy(config)  # its own: max_num_seqs may be clamped to what the pool holds
        if config.model is None:
            raise ValueError("model is required: a checkpoint directory")
        self.config = config
        self.device = config.resolve_device()
        self.hf_config = load_hf_config(config.model)
        self.dtypes: ResolvedDtypes = config.resolve_dtypes(self.hf_config)
        # generation_config.json, read before the weights so that a broken file fails at once
        self._generation_eos_ids = generation_eos_ids(config.model)
        self.generation_defaults = load_generation_defaults(config.generation_config, config.model)
        logger.info(self.generation_defaults.describe())
        torch.manual_seed(config.seed)
        # torch.set_num_threads, before tensor-parallel ranks split the count; logs the OpenMP wait policy in force
        self.thread_setup = setup_threads(config.cpu_threads, config.cpu_reserved_cores, config.cpu_wait_policy)
        # fewer threads while other processes take the cores (kernels/thread_share.py); None when not asked for
        self.thread_share = (ThreadShare(self.thread_setup.threads, self.thread_setup.cores)
                             if config.cpu_adaptive_threads else None)
        self.tp: Launch | None = None  # the tensor-parallel ranks (docs/tensor_parallel.md), None at size 1
        if config.tensor_parallel_size > 1:
            if self.device.type != "cpu":
                raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} runs on the CPU (gloo); "
                                 f"device={config.device!r} resolved to {self.device.type} here: pass device='cpu'")
            check_shardable(self.hf_config, CacheDtypes.from_resolved(self.dtypes), config.tensor_parallel_size)
            self.tp = launch(config)
        try:
            self._build(config)
        except BaseException:
            if self.tp is not None:
                self.tp.stop(grace=0.0)
            raise

    def _build(self, config: EngineConfig) -> None:
        """Everything after the checkpoint's config: model, pool, cache manager, scheduler, fast paths."""
        worker = Worker(config, self.hf_config, self.dtypes, self.device,
                        tp_group=self.tp.group if self.tp is not None else None)
        self.worker = worker
        self.model, self.specs, self.pool = worker.model, worker.specs, worker.pool
        self.cpu_fast_paths, self.cpu_kernels = worker.cpu_fast_paths, worker.cpu_kernels
        self.spec_config, self.draft_model, self.mtp_head = worker.spec_config, worker.draft_model, worker.mtp_head
        self.layout_specs, self.layout = worker.layout_specs, worker.layout
        config.max_num_seqs = fitted_max_num_seqs(config.max_num_seqs, self.layout, self.pool.num_bytes)
        self.cache = CacheManager(self.pool, config.enable_prefix_caching, config.prefix_snapshot_interval)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.driver = DriverModel(self.model, self.pool, self.tp) if self.tp is not None else None
        self.runner = worker.make_runner(self.driver)
        self.max_model_len = worker.max_model_len
        self.generator = torch.Generator().manual_seed(config.seed)
        self.speculator = (make_speculator(self.spec_config, config, self.cache, self.pool, self.device,
                                           self.max_model_len, self.draft_model, self.mtp_head, self.generator)
                           if self.spec_config is not None else None)
        if config.max_model_len:
            past_positions = positions_warning(self.hf_config, self.max_model_len)
            if past_positions:
                logger.warning(past_positions.removeprefix("warning: "))
        worker.capture_decode()
        if self.speculator is not None:
            capture_speculation(self.speculator, self.runner, self.model, self.pool, config, self.max_model_len,
                                self.cpu_fast_paths)
        if self.cpu_fast_paths is not None:
            self.cpu_fast_paths.log()
        tokenizer_path = config.tokenizer or config.model
        assert tokenizer_path is not None, "the engine was built from a model directory"
        self.detokenizer = Detokenizer.from_path(tokenizer_path)
        # every id that ends a sequence: config.json's, generation_config.json's and the tokenizer's (first: the
        # one the grammar engine knows as EOS)
        self.eos_token_ids = end_of_sequence_ids(self.hf_config, str(config.model), self._generation_eos_ids,
                                                 self.detokenizer.tokenizer)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.structured = StructuredOutputManager(self.detokenizer.tokenizer, self.hf_config.vocab_size,
                                                  self.eos_token_id, config.grammar_limits())
        self.fingerprint = config.fingerprint(self.dtypes)
        self._requests = RequestRegistry()  # request id -> its sequences, by completion index
        self._arrivals = itertools.count()
        self._origins = itertools.count()  # one per add_requests call (engine/fair_share.py)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self._kv_events: KVEventRecorder | None = None  # the prefix cache's block events, once enabled
        self.output = OutputProcessor(self._requests, self.scheduler, self.cache, self.structured, self.detokenizer,
                                      self.generator, self.cpu_kernels, self.max_model_len, self.speculator,
                                      self.stats)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Validate and queue a request; raises ValueError on bad input (nothing is queued then)."""
        self.add_requests([(request_id, prompt_token_ids, params, prompt)])

    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams, str | None]]) -> None:
        """Validate every ``(request_id, prompt_token_ids, params, prompt)``, then queue them all: a bad
        one raises ValueError (naming its index when there are several) and nothing is queued.

        The requests of one call are one origin (one caller's submission: an HTTP request, an
        ``LLM.generate`` call), which shares the running slots fairly with other origins
        (``engine/fair_share.py``)."""
        origin = next(self._origins)
        seqs: list[Sequence] = []
        seen: set[str] = set()
        for i, (request_id, ids, params, prompt) in enumerate(requests):
            try:
                if request_id in seen:
                    raise ValueError(f"request_id={request_id!r} is already in use")
                seqs.append(self._new_sequence(request_id, ids, params, prompt, origin))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}" if len(requests) > 1 else str(exc)) from None
            seen.add(request_id)
        for seq in seqs:
            self._requests.add(seq)
            self.stats["prompt_tokens"] += len(seq.prompt_token_ids)
            self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prompt: str | None, origin: int) -> Sequence:
        """A request's first sequence, after checking everything it implies (ValueError otherwise)."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: fields may have been changed since the params were made
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty: at least one token is required")
        params = self._with_model_defaults(params, len(ids))
        vocab = self.hf_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids {sorted(bad)[:5]} are outside the vocabulary [0, {vocab})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if (max_tokens < 1 and params.max_tokens != 0) or len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.max_model_len}")
        if not self.cache.fits_at_all(len(ids) + max_tokens):
            raise ValueError(f"a request of {len(ids) + max_tokens} tokens does not fit in cache_memory="
                             f"{self.config.cache_memory} bytes; raise cache_memory or lower max_tokens")
        self.structured.check(params)  # its grammar compiled (unless already), within the grammar limits
        if params.max_tokens is None:
            params = _with_max_tokens(params, max_tokens)
        return Sequence(request_id, ids, params, next(self._arrivals), prompt, self.eos_token_ids,
                        origin=origin)

    def _with_model_defaults(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """``params`` with the model's generation defaults in the fields it leaves unset; a default ``max_tokens``
        (generation_config.json's ``max_new_tokens``) is cut to what fits after the prompt, as an explicit one is
        not."""
        params = self.generation_defaults.apply(params)
        room = self.max_model_len - prompt_len
        if (not params.is_set("max_tokens") and "max_tokens" in self.generation_defaults.sampling
                and params.max_tokens is not None and params.max_tokens > room >= 1):
            params = params.with_defaults({"max_tokens": room})
        return params

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its cache now, every sequence of it (unknown or finished ids are ignored)."""
        group = self._requests.pop(request_id)
        if group is not None:
            self.output.end(group.seqs, "abort")

    def abort_all(self) -> None:
        """Abort every request (and, defensively, any sequence the scheduler still holds)."""
        for request_id in self._requests.ids():
            self.abort_request(request_id)
        self.scheduler.finish_many(self.scheduler.sequences(), "abort")
        self.structured.release_all()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def has_started(self, request_id: str) -> bool:
        """Whether the request has begun running (or ended): it no longer waits for its first step."""
        group = self._requests.group(request_id)
        if group is None:
            return True
        first = group.seqs[0]
        return first.status != SequenceStatus.WAITING or first.num_preemptions > 0

    # -------------------------------------------------------------------- step
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one batched forward; return outputs of the requests that advanced or finished (with
        ``finished_only``, of those that finished: what a caller waiting for whole results needs,
        without a snapshot of every running request each step).

        A failure is contained to its request: a row that cannot be sampled, or a sequence whose
        output handling raises, fails its own request (``RequestOutput.error``, finish reason
        "error"). A failed forward of several sequences preempts them all (recompute is exact) and
        reruns each alone until the one that fails alone is found; a sequence in
        ``MAX_STEP_FAILURES`` failed steps fails too, so a failure that needs a whole batch to appear
        still ends.
        """
        if self.thread_share is not None and (threads := self.thread_share.poll()) is not None:
            torch.set_num_threads(threads)
        plan = self.scheduler.schedule()
        touched: dict[str, None] = {}  # request ids, in order
        for seq in plan.idle:
            self.output.fail(seq.request_id, "internal error: a running sequence had nothing to compute", touched)
        if not plan.scheduled:
            if not touched and self.scheduler.stalled():
                raise RuntimeError("the cache pool cannot hold the next waiting request")
            return self.output.outputs(touched, finished_only)
        solo = self.scheduler.solo
        logits = self._run(plan.scheduled, solo, touched)
        if logits is not None:
            self._process(plan.scheduled, logits, touched)
            if solo is not None and (solo.is_finished or solo.num_pending_tokens <= 1):
                self.scheduler.cleared(solo)
        return self.output.outputs(touched, finished_only)

    def _run(self, scheduled: list[ScheduledSeq], solo: Sequence | None, touched: dict[str, None]) -> StepLogits | None:
        """The forward over ``scheduled`` (drafts attached first); None when it failed (contained here)."""
        try:
            if self.speculator is not None:
                self.speculator.attach(scheduled, self.scheduler.num_running, may_draft=solo is None)
            return self.runner.run(scheduled)
        except TensorParallelError:
            raise  # the ranks are out of step: the engine is down, not one request
        except Exception as exc:  # noqa: BLE001 - contained below
            self._contain_step_failure([it.seq for it in scheduled], exc, touched)
            return None

    def _process(self, scheduled: list[ScheduledSeq], logits: StepLogits, touched: dict[str, None]) -> None:
        """After a forward: count the computed tokens, let the output processor verify, sample and append,
        and let the prefix cache and an MTP drafter see the step (their failures only turn them off)."""
        for item in scheduled:
            if not item.drafts:  # a verification's computed tokens depend on its verdict
                item.seq.num_computed_tokens += item.num_tokens
        if logits.verify_seqs:
            self.output.verify_and_append(logits, touched)
        try:
            self.cache.after_step([it.seq for it in scheduled])
        except Exception:  # noqa: BLE001 - caching is an optimization: the step's results stand
            logger.exception("prefix caching after a step failed; the cache is cleared")
            self._drop_prefix_cache()
        if logits.prompt_logits is not None:
            self.output.prompt_logprobs(logits, touched)
        if logits.sample_seqs:
            self.output.end_prefill_only(logits.sample_seqs, touched)
            self.output.sample_and_append(logits, touched)
        if self.speculator is not None and self.speculator.mtp is not None:
            try:
                self.speculator.after_step(logits)
            except Exception:  # noqa: BLE001 - drafting is an optimization: the step's results stand
                logger.exception("the MTP head failed after a step; no drafts from it this step")

    def _contain_step_failure(self, seqs: list[Sequence], exc: Exception, touched: dict[str, None]) -> None:
        """A forward over ``seqs`` raised: fail the sequence if it ran alone, else rerun each alone."""
        if len(seqs) == 1:
            logger.error("the model step of request %s failed; failing it", seqs[0].request_id, exc_info=exc)
            self.output.fail(seqs[0].request_id, f"the model step failed: {type(exc).__name__}: {exc}", touched)
            return
        logger.warning("a step of %d sequences failed (%s: %s); rerunning each alone to find the cause",
                       len(seqs), type(exc).__name__, exc, exc_info=exc)
        for seq in sorted(seqs, key=lambda s: s.arrival, reverse=True):  # preempted to the front: oldest first
            seq.num_step_failures += 1
            if seq.num_step_failures >= MAX_STEP_FAILURES:
                self.output.fail(seq.request_id, f"the model step failed {seq.num_step_failures} times: "
                                                 f"{type(exc).__name__}: {exc}", touched)
            else:
                self.scheduler.preempt(seq)
        self.scheduler.suspect(seqs)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at tensor_parallel_size 1) and the grammar compiler's
        worker thread; the engine runs no more steps."""
        self.structured.close()
        if self.driver is not None:
            self.driver.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Evict every cached prefix no request holds (as vLLM's ``reset_prefix_cache``); True if none is left."""
        return self.cache.reset_prefix_cache()

    def enable_kv_events(self) -> None:
        """Record the prefix cache's block events from now on (:mod:`hybridserve.cache.kv_events`; call before
        the first request), for :meth:`take_kv_events`. ValueError with prefix caching off."""
        if not self.cache.prefix_caching:
            raise ValueError("KV cache events describe the prefix cache, which is off: drop --no-enable-prefix-caching")
        self._kv_events = self.cache.enable_prefix_events()

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's block events since the last call (none unless :meth:`enable_kv_events` was called)."""
        return self._kv_events.take() if self._kv_events is not None else []

    def _drop_prefix_cache(self) -> None:
        """Stop caching prefixes for this engine's life (after an internal error in the cache)."""
        self.cache.drop_prefix_cache(self.scheduler.sequences())

    def prefix_cache_stats(self) -> dict[str, int]:
        """Counters and sizes of the prefix cache (zeros when it is off): tokens queried and hit, lookups whose
        KV matched beyond any snapshot, snapshots and their bytes, bytes held only by the cache, evictions."""
        return self.cache.prefix_stats()

    def spec_decode_stats(self) -> dict | None:
        """Speculative decoding's counters (``SpecStats.as_dict``: verifications, draft and accepted tokens,
        acceptance length histogram, back-offs), or None when it is off."""
        return self.speculator.stats.as_dict() if self.speculator is not None else None

    # ----------------------------------------------------------------- inspect
    def cache_layout(self) -> dict[str, Any]:
        """Resolved dtypes, every layer's cached tensors, and pool totals (what the engine really uses)."""
        layout = self.layout
        return {
            **self.dtypes.as_names(),
            "layers": [spec.describe() for spec in self.layout_specs],
            "block_size": layout.block_size,
            "attention_block_size": layout.block_size,
            "kv_bytes_per_token": layout.kv_bytes_per_token,
            "state_bytes_per_sequence": layout.state_bytes_per_sequence,
            "page_bytes": layout.page_bytes,
            "slot_bytes": layout.slot_bytes,
            "pool_bytes": self.pool.num_bytes,
            "num_pages": self.pool.num_pages,
            "num_slots": self.pool.num_slots,
            "max_model_len": self.max_model_len,
            "prefix_caching": self.cache.prefix_caching,
            "prefix_snapshot_interval": self.config.prefix_snapshot_interval,
            "max_concurrent_sequences": max_sequences(layout, self.pool.num_bytes, self.max_model_len),
            "speculation": speculation_summary(self.spec_config, layout, len(self.layout_specs) - len(self.specs)),
            "quantization": self.cpu_fast_paths.quantization if self.cpu_fast_paths is not None else "none",
            "weight_bytes": weight_bytes(self.model),
            # > 1: the layers, pool and weight figures above are one rank's (every rank holds alike)
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import copy

    params = copy.copy(params)
    params.max_tokens = max_tokens
    return params


def end_of_sequence_ids(hf_config: Any, model_folder: str, generation_ids: list[int],
                        tokenizer: Any | None) -> tuple[int, ...]:
    """Every end-of-sequence id, in order and without repeats: config.json's ``eos_token_id`` (an id or a list),
    then generation_config.json's (``generation_ids``), then the tokenizer's."""
    found = token_id_list(getattr(hf_config, "eos_token_id", None), f"{model_folder}/config.json")
    found += generation_ids
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tokenizer_eos, int):
        found.append(tokenizer_eos)
    return tuple(dict.fromkeys(found))


__all__ = ["LLMEngine", "SequenceStatus", "dtype_name"]
