"""The engine: requests in, one batched step at a time, outputs out."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from hybridserve.cache.capacity import max_sequences
from hybridserve.cache.kv_events import KVEvent, KVEventRecorder
from hybridserve.cache.layout import compute_layout
from hybridserve.cache.manager import CacheManager
from hybridserve.cache.pool import CachePool
from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.config import FP8_KV_DTYPES, EngineConfig, ResolvedDtypes, dtype_name
from hybridserve.distributed.driver import DriverModel
from hybridserve.distributed.group import TensorParallelError
from hybridserve.distributed.launch import Launch, launch
from hybridserve.distributed.sharding import check_shardable
from hybridserve.engine.cpu_fast_paths import attach_captured_decode, prepare_model
from hybridserve.engine.detokenizer import Detokenizer
from hybridserve.engine.fork import make_children, place_children, wants_fork
from hybridserve.engine.logit_adjust import LogitAdjuster, RowContext
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.request_registry import RequestRegistry
from hybridserve.engine.sampler import SampleResult, report, sample, sample_rows_alone
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.sequence import Sequence, SequenceStatus
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels.threads import setup_threads
from hybridserve.layers.weight_bytes import weight_bytes
from hybridserve.models.loader import build_model, load_hf_config
from hybridserve.outputs import CompletionOutput, Logprob, RequestOutput
from hybridserve.planning.planner import DEFAULT_MAX_MODEL_LEN, speculation_summary
from hybridserve.sampling_params import SamplingParams
from hybridserve.spec_decode.acceptance import Verification, verify
from hybridserve.spec_decode.config import parse_speculative_config
from hybridserve.spec_decode.setup import capture_speculation, load_drafter, make_speculator
from hybridserve.structured_output.manager import StructuredOutputManager
from hybridserve.structured_output.matcher import FixedMask

logger = logging.getLogger(__name__)

#: a sequence in this many failed steps fails (see LLMEngine.step)
MAX_STEP_FAILURES = 3


class LLMEngine:
    """Loads a checkpoint, owns the pool, schedules and runs steps.

    ``add_request`` validates and queues; ``step`` runs one batched forward and returns the
    outputs of the requests it advanced; ``abort_request`` frees a request's cache at once.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            raise ValueError("model is required: a checkpoint directory")
        self.config = config
        self.device = config.resolve_device()
        self.hf_config = load_hf_config(config.model)
        self.dtypes: ResolvedDtypes = config.resolve_dtypes(self.hf_config)
        torch.manual_seed(config.seed)
        # torch.set_num_threads, before tensor-parallel ranks split the count; logs the OpenMP wait policy in force
        self.thread_setup = setup_threads(config.cpu_threads, config.cpu_reserved_cores, config.cpu_wait_policy)
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
        keep_fp8 = self.device.type == "cpu" and config.cpu_kernels and config.quantization != "none"
        self.model = build_model(config.model, self.hf_config, self.dtypes.model,
                                 CacheDtypes.from_resolved(self.dtypes), self.device, keep_fp8,
                                 tp_group=self.tp.group if self.tp is not None else None)
        self.specs: list[LayerCacheSpec] = self.model.cache_specs()
        self.cpu_fast_paths = prepare_model(self.model, config) if self.device.type == "cpu" else None
        self.cpu_kernels = self.cpu_fast_paths is not None and self.cpu_fast_paths.kernels
        self.spec_config = parse_speculative_config(config.speculative_config)
        self.draft_model, self.mtp_head, draft_specs = (
            load_drafter(self.spec_config, config, self.hf_config, self.model, self.specs, self.dtypes, self.device)
            if self.spec_config is not None else (None, None, []))
        self.layout_specs = self.specs + draft_specs  # the target's layers, then a drafter's (draft model, MTP)
        self.layout = compute_layout(self.layout_specs, config.block_size)
        self.pool = CachePool(self.layout, config.cache_memory, self.device)
        apply_kv_scales(self.model, self.pool, self.dtypes.kv_cache)
        if self.draft_model is not None:
            apply_kv_scales(self.draft_model.model, self.pool, self.dtypes.kv_cache, self.draft_model.offset)
        self.cache = CacheManager(self.pool, config.enable_prefix_caching, config.prefix_snapshot_interval)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.driver = DriverModel(self.model, self.pool, self.tp) if self.tp is not None else None
        self.runner = ModelRunner(self.driver or self.model, self.pool, self.device)
        self.max_model_len = config.max_model_len or default_max_model_len(self.hf_config)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.speculator = (make_speculator(self.spec_config, config, self.cache, self.pool, self.device,
                                           self.max_model_len, self.draft_model, self.mtp_head, self.generator)
                           if self.spec_config is not None else None)
        if config.max_model_len:
            from hybridserve.planning.planner import positions_warning

            past_positions = positions_warning(self.hf_config, self.max_model_len)
            if past_positions:
                logger.warning(past_positions.removeprefix("warning: "))
        if self.cpu_fast_paths is not None:
            attach_captured_decode(self.runner, self.model, self.pool, config, self.max_model_len,
                                   self.cpu_fast_paths, eager_reason=tensor_parallel_reason(config))
        if self.speculator is not None:
            capture_speculation(self.speculator, self.runner, self.model, self.pool, config, self.max_model_len,
                                self.cpu_fast_paths)
        if self.cpu_fast_paths is not None:
            self.cpu_fast_paths.log()
        self.detokenizer = Detokenizer.from_path(config.tokenizer or config.model)
        self.eos_token_id = _eos_token_id(self.hf_config, self.detokenizer)
        self.structured = StructuredOutputManager(self.detokenizer.tokenizer, self.hf_config.vocab_size,
                                                  self.eos_token_id, config.grammar_limits())
        self.fingerprint = config.fingerprint(self.dtypes)
        self._requests = RequestRegistry()  # request id -> its sequences, by completion index
        self._arrivals = itertools.count()
        self._origins = itertools.count()  # one per add_requests call (engine/fair_share.py)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self._kv_events: KVEventRecorder | None = None  # the prefix cache's block events, once enabled

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
        return Sequence(request_id, ids, params, next(self._arrivals), prompt, self.eos_token_id, origin=origin)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its cache now, every sequence of it (unknown or finished ids are ignored)."""
        group = self._requests.pop(request_id)
        if group is not None:
            self._end(group.seqs, "abort")

    def abort_all(self) -> None:
        """Abort every request (and, defensively, any sequence the scheduler still holds)."""
        for request_id in self._requests.ids():
            self.abort_request(request_id)
        self.scheduler.finish_many(list(self.scheduler.running) + list(self.scheduler.waiting), "abort")
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
        plan = self.scheduler.schedule()
        touched: dict[str, None] = {}  # request ids, in order
        for seq in plan.idle:
            self._fail(seq.request_id, "internal error: a running sequence had nothing to compute", touched)
        if not plan.scheduled:
            if not touched and self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("the cache pool cannot hold the next waiting request")
            return self._outputs(touched, finished_only)
        solo = self.scheduler.solo
        try:
            if self.speculator is not None:
                self.speculator.attach(plan.scheduled, len(self.scheduler.running), may_draft=solo is None)
            logits = self.runner.run(plan.scheduled)
        except TensorParallelError:
            raise  # the ranks are out of step: the engine is down, not one request
        except Exception as exc:  # noqa: BLE001 - contained below
            self._contain_step_failure([it.seq for it in plan.scheduled], exc, touched)
            return self._outputs(touched, finished_only)
        for item in plan.scheduled:
            if not item.drafts:  # a verification's computed tokens depend on its verdict
                item.seq.num_computed_tokens += item.num_tokens
        if logits.verify_seqs:
            self._verify_and_append(logits, touched)
        try:
            self.cache.after_step([it.seq for it in plan.scheduled])
        except Exception:  # noqa: BLE001 - caching is an optimization: the step's results stand
            logger.exception("prefix caching after a step failed; the cache is cleared")
            self._drop_prefix_cache()
        if logits.prompt_logits is not None:
            try:
                self._record_prompt_logprobs(logits)
            except Exception as exc:  # noqa: BLE001 - fails the requests that asked for prompt logprobs
                logger.exception("prompt logprobs failed")
                for item, _, _ in logits.prompt_seqs:
                    self._fail(item.seq.request_id, f"prompt logprobs failed: {type(exc).__name__}: {exc}", touched)
        if logits.sample_seqs:
            self._end_prefill_only(logits.sample_seqs, touched)
            self._sample_and_append(logits, touched)
        if self.speculator is not None and self.speculator.mtp is not None:
            try:
                self.speculator.after_step(logits)
            except Exception:  # noqa: BLE001 - drafting is an optimization: the step's results stand
                logger.exception("the MTP head failed after a step; no drafts from it this step")
        if solo is not None and (solo.is_finished or solo.num_pending_tokens <= 1):
            self.scheduler.cleared(solo)
        return self._outputs(touched, finished_only)

    def _end_prefill_only(self, items, touched: dict[str, None]) -> None:
        """End the sequences with ``max_tokens=0`` whose prompt is now computed (its prompt logprobs recorded):
        they generate nothing. With ``n > 1`` the request gets its ``n - 1`` other completions, empty too,
        without forking any cache."""
        for item in items:
            seq = item.seq
            if seq.is_finished or seq.params.max_tokens != 0:
                continue
            if wants_fork(seq):
                children = make_children(seq)  # they hold no cache: nothing to compute
                self._requests.extend(seq.request_id, children)
                self._end(children, "length")
            self._end([seq], "length")
            touched[seq.request_id] = None

    def _sample_and_append(self, logits, touched: dict[str, None]) -> None:
        """Fork the parents that sample their first token, sample every row, append and check stops."""
        seqs = [it.seq for it in logits.sample_seqs]
        rows = list(range(len(seqs)))  # logits row of each sampling sequence
        for row, seq in enumerate(list(seqs)):
            if seq.is_finished or not wants_fork(seq):
                continue
            try:  # n > 1: the prompt is prefilled; children copy its cache
                children = make_children(seq)
                self._requests.extend(seq.request_id, children)  # registered before any holds cache
                ready = place_children(seq, children, self.cache, self.scheduler)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                logger.exception("forking request %s failed", seq.request_id)
                self._fail(seq.request_id, f"fork failed: {type(exc).__name__}: {exc}", touched)
                continue
            seqs.extend(ready)
            rows.extend([row] * len(ready))
        regather = len(seqs) > len(logits.sample_seqs)  # children share their parent's row
        if any(seq.is_finished for seq in seqs):  # a request failed in this step (its fork, prompt logprobs)
            keep = [i for i, seq in enumerate(seqs) if not seq.is_finished]
            seqs, rows, regather = [seqs[i] for i in keep], [rows[i] for i in keep], True
        if not seqs:
            return
        sample_logits = logits.sample_logits
        if regather:
            sample_logits = sample_logits[rows]  # (rows, V)
        args = (sample_logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator,
                self.cpu_kernels, self._logit_adjuster(seqs))
        try:
            result = sample(*args)
        except Exception:  # noqa: BLE001 - find the row that fails alone
            logger.exception("batched sampling failed; sampling each row alone")
            result = sample_rows_alone(*args)
        for row, seq in enumerate(seqs):
            if seq.is_finished:
                continue  # its request failed with a sibling's row
            if row in result.errors:
                self._fail(seq.request_id, result.errors[row], touched)
                continue
            try:
                self._append_token(seq, row, result)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                logger.exception("handling the token of request %s failed", seq.request_id)
                self._fail(seq.request_id, f"output handling failed: {type(exc).__name__}: {exc}", touched)
                continue
            touched[seq.request_id] = None

    def _verify_and_append(self, logits, touched: dict[str, None]) -> None:
        """Accept or reject each verified sequence's drafts, append the tokens its verdict emits (up to a
        stop), and set what its cache holds (``Speculator.settle``)."""
        items = logits.verify_seqs
        adjust = self._verify_adjuster(items)
        fused = (pointwise_kernels.argmax_logsumexp(logits.verify_logits, with_max=True)
                 if self.cpu_kernels and adjust is None else None)
        draw_from = adjust(logits.verify_logits.float()) if adjust is not None else logits.verify_logits
        verdicts = verify(draw_from, [Verification(it.drafts, it.seq.params, it.seq.generator, it.draft_probs)
                                      for it in items],
                          self.generator, self.cpu_kernels, fused[0] if fused is not None else None)
        rows = [row for v in verdicts for row in v.rows]
        chosen = [t for v in verdicts for t in v.tokens]
        params = [it.seq.params for it, v in zip(items, verdicts) for _ in v.tokens]
        if fused is not None and all(p.greedy and p.logprobs is None for p in params):
            # every token is its row's argmax: its logprob is the row's maximum less its logsumexp
            _, lse, mx = fused
            lp = (mx - lse).tolist()  # float32 subtraction, as the sampler's
            result = SampleResult(chosen, [lp[r] for r in rows], [0] * len(rows), [[]] * len(rows), [[]] * len(rows))
        else:
            result = report(logits.verify_logits[rows].float(), torch.tensor(chosen), params)
        flat = 0
        for item, verdict in zip(items, verdicts):
            seq = item.seq
            emitted = 0
            if verdict.error is not None:
                self._fail(seq.request_id, verdict.error, touched)
            for _ in verdict.tokens:
                if seq.is_finished:
                    break
                try:
                    self._append_token(seq, flat + emitted, result)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    logger.exception("handling the token of request %s failed", seq.request_id)
                    self._fail(seq.request_id, f"output handling failed: {type(exc).__name__}: {exc}", touched)
                emitted += 1
            flat += len(verdict.tokens)
            touched[seq.request_id] = None
            self.speculator.settle(item, verdict.num_accepted, emitted)

    def _verify_adjuster(self, items) -> LogitAdjuster | None:
        """Penalties, biases, stop masks and grammar masks of every verification row (row ``j`` of a sequence as
        after its first ``j`` drafts, the context decoding would have there); None when no row has any."""
        if not any(it.seq.params.adjusts_logits for it in items):
            return None
        rows = []
        for it in items:
            seq, m = it.seq, len(it.drafts)
            masks = None
            if seq.params.structured_outputs is not None:  # the grammar's masks as after each draft
                matcher = self.structured.matcher(seq)
                masks = torch.empty(m + 1, matcher.num_words, dtype=torch.int32)  # (m + 1, W)
                matcher.draft_masks(it.drafts, masks)
            rows += [RowContext(seq.params, seq.prompt_token_ids, seq.output_token_ids + it.drafts[:j],
                                seq.eos_token_id, FixedMask(masks[j]) if masks is not None else None)
                     for j in range(m + 1)]
        adjuster = LogitAdjuster(rows)
        return adjuster if adjuster else None

    def _logit_adjuster(self, seqs: list[Sequence]) -> LogitAdjuster | None:
        """Penalties, biases and masks of the rows about to be sampled; None when no row has any."""
        if not any(s.params.adjusts_logits for s in seqs):
            return None
        rows = [RowContext(s.params, s.prompt_token_ids, s.output_token_ids, s.eos_token_id,
                           self.structured.matcher(s) if s.params.structured_outputs is not None else None)
                for s in seqs]
        adjuster = LogitAdjuster(rows)
        return adjuster if adjuster else None

    def _contain_step_failure(self, seqs: list[Sequence], exc: Exception, touched: dict[str, None]) -> None:
        """A forward over ``seqs`` raised: fail the sequence if it ran alone, else rerun each alone."""
        if len(seqs) == 1:
            logger.error("the model step of request %s failed; failing it", seqs[0].request_id, exc_info=exc)
            self._fail(seqs[0].request_id, f"the model step failed: {type(exc).__name__}: {exc}", touched)
            return
        logger.warning("a step of %d sequences failed (%s: %s); rerunning each alone to find the cause",
                       len(seqs), type(exc).__name__, exc, exc_info=exc)
        for seq in sorted(seqs, key=lambda s: s.arrival, reverse=True):  # preempted to the front: oldest first
            seq.num_step_failures += 1
            if seq.num_step_failures >= MAX_STEP_FAILURES:
                self._fail(seq.request_id, f"the model step failed {seq.num_step_failures} times: "
                                           f"{type(exc).__name__}: {exc}", touched)
            else:
                self.scheduler.preempt(seq)
        self.scheduler.suspects.extend(s for s in sorted(seqs, key=lambda s: s.arrival) if not s.is_finished)

    def _fail(self, request_id: str, message: str, touched: dict[str, None]) -> None:
        """End every sequence of the request with reason "error"; its output carries ``message``."""
        group = self._requests.group(request_id)
        if group is None:
            return
        if group.error is None:
            group.error = message
            logger.warning("request %s failed: %s", request_id, message)
        self._end(group.seqs, "error")
        touched[request_id] = None

    def _end(self, seqs: list[Sequence], reason: str, stop_reason: int | str | None = None) -> None:
        """Finish ``seqs`` (those not finished yet) and count them in their request group."""
        newly = [seq for seq in seqs if not seq.is_finished]
        if len(newly) == 1:
            self.scheduler.finish(newly[0], reason, stop_reason)
        else:
            self.scheduler.finish_many(newly, reason)
        for seq in newly:
            self._requests.count_finished(seq)
        self.structured.release(newly)

    def _outputs(self, touched: dict[str, None], finished_only: bool) -> list[RequestOutput]:
        if finished_only:
            return [self._output(rid) for rid in touched if self._finished(rid)]
        return [self._output(rid) for rid in touched if rid in self._requests]

    def _finished(self, request_id: str) -> bool:
        group = self._requests.group(request_id)
        return group is not None and group.finished

    def _record_prompt_logprobs(self, logits) -> None:
        all_lp = torch.log_softmax(logits.prompt_logits, dim=-1)  # (R, V)
        row = 0
        for item, start, count in logits.prompt_seqs:
            seq = item.seq
            k = seq.params.prompt_logprobs or 0
            block = all_lp[row:row + count]
            row += count
            targets = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + count])
            target_lp = block.gather(1, targets[:, None].to(block.device))[:, 0]
            ranks = (block > target_lp[:, None]).sum(-1) + 1
            top_v, top_i = block.topk(k, dim=-1) if k > 0 else (None, None)
            for j in range(count):
                if len(seq.prompt_logprobs) != start + 1 + j:
                    continue  # already recorded before a preemption
                entry = {}
                if k > 0:
                    for tid, lp in zip(top_i[j].tolist(), top_v[j].tolist()):
                        entry[tid] = Logprob(lp, None)
                    for rank, tid in enumerate(top_i[j].tolist(), start=1):
                        entry[tid].rank = rank
                tid = int(targets[j])
                entry[tid] = Logprob(float(target_lp[j]), int(ranks[j]))
                seq.prompt_logprobs.append(self.detokenizer.annotate(entry))

    def _append_token(self, seq: Sequence, row: int, result) -> None:
        token = result.token_ids[row]
        self.structured.accept(seq, token)  # before the token counts: a refused one fails the request
        seq.output_token_ids.append(token)
        self.stats["generation_tokens"] += 1
        seq.cumulative_logprob += result.sampled_logprobs[row]
        if seq.params.logprobs is not None:
            entry = {tid: Logprob(lp, rank) for rank, (tid, lp) in
                     enumerate(zip(result.top_ids[row], result.top_logprobs[row]), start=1)}
            if token not in entry:
                entry[token] = Logprob(result.sampled_logprobs[row], result.sampled_ranks[row])
            seq.output_logprobs.append(self.detokenizer.annotate(entry) if seq.params.detokenize else entry)
        self._check_stop(seq, token)

    def sync_text(self, seq: Sequence) -> None:
        """Detokenize the output tokens ``seq.output_text`` does not cover yet (incrementally).

        Text is decoded when it is read (a stop-string check, an output snapshot), not at every token: a
        request without stop strings whose caller wants only finished outputs decodes once, at its end."""
        if not seq.params.detokenize or seq.text_final:
            return
        if seq.decoder is None:
            seq.decoder = self.detokenizer.incremental(seq.params.skip_special_tokens)
        delta = seq.decoder.add(seq.output_token_ids)
        if delta:
            seq.output_text += delta

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        num_out = len(seq.output_token_ids)
        text_before = seq.output_text
        if params.stop_strings:
            self.sync_text(seq)  # every token: a stop string is searched for in the text it adds
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token == seq.eos_token_id:
                self._finish(seq, "stop", None)
                return
            if params.stop_token_ids and token in params.stop_token_ids:
                self._finish(seq, "stop", token)
                return
            for stop in params.stop_strings:
                start = max(0, len(text_before) - len(stop))
                pos = seq.output_text.find(stop, start)
                if pos >= 0:
                    end = pos + len(stop) if params.include_stop_str_in_output else pos
                    seq.output_text, seq.text_final = seq.output_text[:end], True
                    self._end([seq], "stop", stop)
                    return
        if self.structured.finished(seq):  # the grammar is complete: nothing but EOS could follow
            self._finish(seq, "stop", None)
            return
        if num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | None) -> None:
        """Finish ``seq`` (not at a stop string); its final text is the whole output decoded at once."""
        if seq.params.detokenize:
            seq.output_text = self.detokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
            seq.text_final = True
        self._end([seq], reason, stop_reason)

    def _output(self, request_id: str) -> RequestOutput:
        """The request's output so far: one completion per sequence (``n`` once forked)."""
        group = self._requests.group(request_id)
        for seq in group.seqs:
            self.sync_text(seq)
        completions = [CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason) for seq in group.seqs]
        parent = group.seqs[0]
        finished = group.finished
        if finished:
            self._requests.pop(request_id)
        return RequestOutput(request_id, parent.prompt, list(parent.prompt_token_ids),
                             list(parent.prompt_logprobs) if parent.params.prompt_logprobs is not None else None,
                             completions, finished, num_cached_tokens=parent.num_cached_tokens or 0,
                             error=group.error)

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
        if self.cache.prefix is None:
            raise ValueError("KV cache events describe the prefix cache, which is off: drop --no-enable-prefix-caching")
        self._kv_events = self.cache.prefix.enable_events()

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's block events since the last call (none unless :meth:`enable_kv_events` was called)."""
        return self._kv_events.take() if self._kv_events is not None else []

    def _drop_prefix_cache(self) -> None:
        """Stop caching prefixes for this engine's life (after an internal error in the cache)."""
        prefix = self.cache.prefix
        if prefix is not None:
            prefix.drop_all(list(self.scheduler.running) + list(self.scheduler.waiting))
            self.cache.prefix = None

    def prefix_cache_stats(self) -> dict[str, int]:
        """Counters and sizes of the prefix cache (zeros when it is off): tokens queried and hit, lookups whose
        KV matched beyond any snapshot, snapshots and their bytes, bytes held only by the cache, evictions."""
        prefix = self.cache.prefix
        names = ("queries", "hits", "kv_beyond_snapshot", "snapshots_taken", "snapshots_skipped",
                 "evicted_pages", "evicted_snapshots")
        if prefix is None:
            return dict.fromkeys((*names, "snapshots", "snapshot_bytes", "cached_pages", "cached_bytes"), 0)
        stats = {name: getattr(prefix.stats, name) for name in names}
        stats.update(snapshots=prefix.num_snapshots, snapshot_bytes=prefix.snapshot_bytes,
                     cached_pages=prefix.num_cached_pages, cached_bytes=self.cache.cached_bytes())
        return stats

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
            "padding_reserved_bytes": self.pool.reserved_bytes(),
            "prefix_caching": self.cache.prefix is not None,
            "prefix_snapshot_interval": self.config.prefix_snapshot_interval,
            "max_concurrent_sequences": max_sequences(layout, self.pool.num_bytes, self.max_model_len,
                                                      self.pool.reserved_counts()),
            "speculation": speculation_summary(self.spec_config, layout, len(self.layout_specs) - len(self.specs)),
            "quantization": self.cpu_fast_paths.quantization if self.cpu_fast_paths is not None else "none",
            "weight_bytes": weight_bytes(self.model),
            # > 1: the layers, pool and weight figures above are one rank's (every rank holds alike)
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }


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


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import copy

    params = copy.copy(params)
    params.max_tokens = max_tokens
    return params


def default_max_model_len(hf_config: Any) -> int:
    """``max_model_len`` when none is given: the checkpoint's ``max_position_embeddings``, capped at 4096."""
    value = getattr(hf_config, "max_position_embeddings", None)
    return int(min(value, DEFAULT_MAX_MODEL_LEN)) if value else DEFAULT_MAX_MODEL_LEN


def _eos_token_id(hf_config: Any, detok: "Detokenizer") -> int | None:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None and detok.tokenizer is not None:
        eos = detok.tokenizer.eos_token_id
    return eos


__all__ = ["LLMEngine", "SequenceStatus", "dtype_name"]
