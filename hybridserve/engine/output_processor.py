"""The output processor: sampling, verification of drafts, appends, stop checks, detokenization, outputs.

After each forward the engine hands the step's logits here; this module turns them into tokens, appends
them to their sequences, ends the sequences that stop (:mod:`hybridserve.engine.stop_check`) and builds
the requests' outputs. A failure is contained to its request: it ends with reason "error".
"""

from __future__ import annotations

import logging

import torch

from hybridserve.cache.manager import CacheManager
from hybridserve.engine.detokenizer import Detokenizer
from hybridserve.engine.fork import make_children, place_children, wants_fork
from hybridserve.engine.logit_adjust import LogitAdjuster, RowContext
from hybridserve.engine.model_runner import StepLogits
from hybridserve.engine.request_registry import RequestRegistry
from hybridserve.engine.sampler import SampleResult, report, sample, sample_rows_alone
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.sequence import Sequence
from hybridserve.engine.stop_check import check_stop
from hybridserve.ops.dispatch import use_kernels
from hybridserve.ops.logits import fused_argmax_logsumexp
from hybridserve.outputs import CompletionOutput, Logprob, RequestOutput
from hybridserve.spec_decode.acceptance import Verification, verify
from hybridserve.spec_decode.speculator import Speculator
from hybridserve.structured_output.manager import StructuredOutputManager
from hybridserve.structured_output.matcher import FixedMask

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Turns a step's logits into tokens, appends and stops, and builds outputs (see the module docstring).

    ``touched`` (every method that takes it): the ids of the requests the step advanced or ended, in order;
    the methods add to it.
    """

    def __init__(self, requests: RequestRegistry, scheduler: Scheduler, cache: CacheManager,
                 structured: StructuredOutputManager, detokenizer: Detokenizer, generator: torch.Generator,
                 cpu_kernels: bool, max_model_len: int, speculator: Speculator | None,
                 stats: dict[str, int]) -> None:
        self.requests, self.scheduler, self.cache = requests, scheduler, cache
        self.structured, self.detokenizer, self.generator = structured, detokenizer, generator
        self.cpu_kernels, self.max_model_len, self.speculator = cpu_kernels, max_model_len, speculator
        self.stats = stats  # the engine's token counters

    def prompt_logprobs(self, logits: StepLogits, touched: dict[str, None]) -> None:
        """Record the prompt logprobs of the step's rows that asked for them; a failure fails those requests."""
        try:
            self._record_prompt_logprobs(logits)
        except Exception as exc:  # noqa: BLE001 - fails the requests that asked for prompt logprobs
            logger.exception("prompt logprobs failed")
            for item, _, _ in logits.prompt_seqs:
                self.fail(item.seq.request_id, f"prompt logprobs failed: {type(exc).__name__}: {exc}", touched)

    def end_prefill_only(self, items, touched: dict[str, None]) -> None:
        """End the sequences with ``max_tokens=0`` whose prompt is now computed (its prompt logprobs recorded):
        they generate nothing. With ``n > 1`` the request gets its ``n - 1`` other completions, empty too,
        without forking any cache."""
        for item in items:
            seq = item.seq
            if seq.is_finished or seq.params.max_tokens != 0:
                continue
            if wants_fork(seq):
                children = make_children(seq)  # they hold no cache: nothing to compute
                self.requests.extend(seq.request_id, children)
                self.end(children, "length")
            self.end([seq], "length")
            touched[seq.request_id] = None

    def sample_and_append(self, logits: StepLogits, touched: dict[str, None]) -> None:
        """Fork the parents that sample their first token, sample every row, append and check stops."""
        seqs = [it.seq for it in logits.sample_seqs]
        rows = list(range(len(seqs)))  # logits row of each sampling sequence
        for row, seq in enumerate(list(seqs)):
            if seq.is_finished or not wants_fork(seq):
                continue
            try:  # n > 1: the prompt is prefilled; children copy its cache
                children = make_children(seq)
                self.requests.extend(seq.request_id, children)  # registered before any holds cache
                ready = place_children(seq, children, self.cache, self.scheduler)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                logger.exception("forking request %s failed", seq.request_id)
                self.fail(seq.request_id, f"fork failed: {type(exc).__name__}: {exc}", touched)
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
        assert sample_logits is not None, "a step with sampling rows has their logits"
        if regather:
            sample_logits = sample_logits[rows]  # (rows, V)
        args = (sample_logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator,
                self._logit_adjuster(seqs))
        with use_kernels(self.cpu_kernels):
            try:
                result = sample(*args)
            except Exception:  # noqa: BLE001 - find the row that fails alone
                logger.exception("batched sampling failed; sampling each row alone")
                result = sample_rows_alone(*args)
        for row, seq in enumerate(seqs):
            if seq.is_finished:
                continue  # its request failed with a sibling's row
            if row in result.errors:
                self.fail(seq.request_id, result.errors[row], touched)
                continue
            try:
                self._append_token(seq, row, result)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                logger.exception("handling the token of request %s failed", seq.request_id)
                self.fail(seq.request_id, f"output handling failed: {type(exc).__name__}: {exc}", touched)
                continue
            touched[seq.request_id] = None

    def verify_and_append(self, logits: StepLogits, touched: dict[str, None]) -> None:
        """Accept or reject each verified sequence's drafts, append the tokens its verdict emits (up to a
        stop), and set what its cache holds (``Speculator.settle``)."""
        items, verify_logits, speculator = logits.verify_seqs, logits.verify_logits, self.speculator
        assert verify_logits is not None and speculator is not None, "a verification step has its logits"
        adjust = self._verify_adjuster(items)
        with use_kernels(self.cpu_kernels):
            fused = fused_argmax_logsumexp(verify_logits, with_max=True) if adjust is None else None
            draw_from = adjust(verify_logits.float()) if adjust is not None else verify_logits
            verdicts = verify(draw_from, [Verification(it.drafts, it.seq.params, it.seq.generator, it.draft_probs)
                                          for it in items],
                              self.generator, fused[0] if fused is not None else None)
        rows = [row for v in verdicts for row in v.rows]
        chosen = [t for v in verdicts for t in v.tokens]
        params = [it.seq.params for it, v in zip(items, verdicts) for _ in v.tokens]
        if fused is not None and all(p.greedy and p.logprobs is None for p in params):
            # every token is its row's argmax: its logprob is the row's maximum less its logsumexp
            _, lse, mx = fused
            lp = (mx - lse).tolist()  # float32 subtraction, as the sampler's
            result = SampleResult(chosen, [lp[r] for r in rows], [0] * len(rows), [[]] * len(rows), [[]] * len(rows))
        else:
            result = report(verify_logits[rows].float(), torch.tensor(chosen), params)
        flat = 0
        for item, verdict in zip(items, verdicts):
            seq = item.seq
            emitted = 0
            if verdict.error is not None:
                self.fail(seq.request_id, verdict.error, touched)
            for _ in verdict.tokens:
                if seq.is_finished:
                    break
                try:
                    self._append_token(seq, flat + emitted, result)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    logger.exception("handling the token of request %s failed", seq.request_id)
                    self.fail(seq.request_id, f"output handling failed: {type(exc).__name__}: {exc}", touched)
                emitted += 1
            flat += len(verdict.tokens)
            touched[seq.request_id] = None
            speculator.settle(item, verdict.num_accepted, emitted)

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
                                seq.eos_token_ids, FixedMask(masks[j]) if masks is not None else None)
                     for j in range(m + 1)]
        adjuster = LogitAdjuster(rows)
        return adjuster if adjuster else None

    def _logit_adjuster(self, seqs: list[Sequence]) -> LogitAdjuster | None:
        """Penalties, biases and masks of the rows about to be sampled; None when no row has any."""
        if not any(s.params.adjusts_logits for s in seqs):
            return None
        rows = [RowContext(s.params, s.prompt_token_ids, s.output_token_ids, s.eos_token_ids,
                           self.structured.matcher(s) if s.params.structured_outputs is not None else None)
                for s in seqs]
        adjuster = LogitAdjuster(rows)
        return adjuster if adjuster else None

    def _record_prompt_logprobs(self, logits: StepLogits) -> None:
        assert logits.prompt_logits is not None, "a step with prompt logprobs rows has their logits"
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
                if top_i is not None and top_v is not None:  # k > 0
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
        self._check_stop(seq)

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

    def _check_stop(self, seq: Sequence) -> None:
        """End ``seq`` if its last token stops it (:func:`hybridserve.engine.stop_check.check_stop`)."""
        text_before = len(seq.output_text)
        if seq.params.stop_strings:
            self.sync_text(seq)  # every token: a stop string is searched for in the text it adds
        stop = check_stop(seq, text_before, self.structured.finished(seq), self.max_model_len)
        if stop is None:
            return
        if stop.text_end is not None:  # a stop string: the text is cut there, final
            seq.output_text, seq.text_final = seq.output_text[:stop.text_end], True
            self.end([seq], stop.reason, stop.stop_reason)
        else:
            self._finish(seq, stop.reason, stop.stop_reason, stop.by_eos)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None, by_eos: bool = False) -> None:
        """Finish ``seq`` (not at a stop string); its final text is the whole output decoded at once, less the
        end-of-sequence token that ended it (never printed, special or not)."""
        if seq.params.detokenize:
            tokens = seq.output_token_ids[:-1] if by_eos else seq.output_token_ids
            seq.output_text = self.detokenizer.decode(tokens, seq.params.skip_special_tokens)
            seq.text_final = True
        self.end([seq], reason, stop_reason)

    def fail(self, request_id: str, message: str, touched: dict[str, None]) -> None:
        """End every sequence of the request with reason "error"; its output carries ``message``."""
        group = self.requests.group(request_id)
        if group is None:
            return
        if group.error is None:
            group.error = message
            logger.warning("request %s failed: %s", request_id, message)
        self.end(group.seqs, "error")
        touched[request_id] = None

    def end(self, seqs: list[Sequence], reason: str, stop_reason: int | str | None = None) -> None:
        """Finish ``seqs`` (those not finished yet) and count them in their request group."""
        newly = [seq for seq in seqs if not seq.is_finished]
        if len(newly) == 1:
            self.scheduler.finish(newly[0], reason, stop_reason)
        else:
            self.scheduler.finish_many(newly, reason)
        for seq in newly:
            self.requests.count_finished(seq)
        self.structured.release(newly)

    def outputs(self, touched: dict[str, None], finished_only: bool) -> list[RequestOutput]:
        if finished_only:
            return [self._output(rid) for rid in touched if self._finished(rid)]
        return [self._output(rid) for rid in touched if rid in self.requests]

    def _finished(self, request_id: str) -> bool:
        group = self.requests.group(request_id)
        return group is not None and group.finished

    def _output(self, request_id: str) -> RequestOutput:
        """The request's output so far: one completion per sequence (``n`` once forked)."""
        group = self.requests.group(request_id)
        assert group is not None, f"request {request_id} is registered"
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
            self.requests.pop(request_id)
        return RequestOutput(request_id, parent.prompt, list(parent.prompt_token_ids),
                             list(parent.prompt_logprobs) if parent.params.prompt_logprobs is not None else None,
                             completions, finished, num_cached_tokens=parent.num_cached_tokens or 0,
                             error=group.error, prefix_cache=parent.prefix_cache)
