"""The engine in a background thread, fed by asyncio callers (the HTTP server).

:class:`LLMEngine` is synchronous and not thread-safe. :class:`AsyncEngine` gives it one thread of
its own: that thread alone touches the engine. Callers on the asyncio loop never call the engine;
they post commands (add, abort) to a queue that the engine thread drains before every step, and
get each request's outputs back through an :class:`OutputSink` (called on the asyncio loop). Every
in-flight request is in the same engine, so they all share its batches.

Outputs are cumulative (each holds the whole text so far), so a sink keeps only the latest one per
request: a slow reader costs no memory however far behind it falls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hybridserve.cache.kv_events import KVEvent
from hybridserve.distributed.group import TensorParallelError
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.metrics import Histogram
from hybridserve.engine.output_sink import OutputSink
from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: buckets (seconds) of the latency histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the request was not accepted."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or failed) and accepts no more requests."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (the others go on); ``message`` is for the log, not the client."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
        self.message = message


@dataclass
class NewRequest:
    """One engine request to queue: its id, prompt token ids, sampling params and prompt text."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass
class EngineSnapshot:
    """Gauges and counters as of the engine thread's last iteration (safe to read from any thread)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache: dict[str, int] = field(default_factory=dict)  # LLMEngine.prefix_cache_stats()
    spec_decode: dict | None = None  # LLMEngine.spec_decode_stats() (None: no speculative decoding)
    cpu_threads: int = 0  # the engine thread's compute threads now
    cpu_thread_changes: int = 0  # changes made by cpu_adaptive_threads (kernels/thread_share.py)


@dataclass
class _Tracked:
    """Per-request bookkeeping of the engine thread (sink, timings)."""

    sink: OutputSink
    arrival: float
    num_tokens: int = 0
    last_token_time: float | None = None
    last: RequestOutput | None = None  # the latest output delivered


class AsyncEngine:
    """Runs ``engine`` in a background thread; ``add_request`` / ``abort`` from the asyncio loop.

    ``max_waiting`` bounds the requests accepted but not yet started (``None``: no bound), exactly:
    every prompt of a call counts up front, and a call that would pass the bound is refused whole
    with :class:`QueueFullError`, so a flood of requests cannot grow memory without limit.

    A request that fails inside the engine fails alone: its sink raises :class:`RequestFailedError`.
    A step that fails as a whole (a bug) fails the requests in flight; repeated failures back off
    (up to ``MAX_BACKOFF_S``) instead of spinning.
    """

    #: the longest pause between engine steps that keep failing
    MAX_BACKOFF_S = 1.0

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 kv_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        """``kv_events``: called in the engine thread with the prefix cache's block events of each step
        (:meth:`LLMEngine.take_kv_events`; the engine must record them), e.g. a publisher's ``publish``."""
        self.engine = engine
        self.max_waiting = max_waiting
        self.kv_events = kv_events
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.snapshot = EngineSnapshot()
        self.num_requests_finished = 0  # engine thread writes: requests that finished without an error
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._unstarted = 0  # requests accepted (or being added) and not yet started: both threads, under the lock
        self._unstarted_lock = threading.Lock()
        self._unstarted_ids: set[str] = set()  # engine thread only: accepted, not yet started
        self._failures = 0  # engine thread only: consecutive failed steps
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stopping = threading.Event()  # set with _stop: ends a back-off pause at once
        self.accepting = False
        self.down_reason: str | None = None  # set when the engine failed for good (a tensor-parallel rank died)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (call from the asyncio loop that will read the outputs)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self.accepting = True
        self._thread.start()

    def stop_accepting(self) -> None:
        self.accepting = False

    async def shutdown(self) -> None:
        """Stop accepting, abort whatever is still in flight, and join the engine thread."""
        self.accepting = False
        self._stop = True
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def abort_all(self) -> None:
        """Abort every request in flight (each caller gets its final, aborted output)."""
        self._post(("abort_all",))

    # ------------------------------------------------------------- requests
    def num_waiting(self) -> int:
        """Requests accepted (or being added) and not yet started: what ``max_waiting`` bounds."""
        return self._unstarted

    def _reserve(self, count: int) -> None:
        with self._unstarted_lock:
            if self.max_waiting is not None and self._unstarted + count > self.max_waiting:
                waiting = self._unstarted
                raise QueueFullError(f"the server is busy: {waiting} requests are waiting and this one adds "
                                     f"{count} (the bound is {self.max_waiting}); retry later")
            self._unstarted += count

    def _unreserve(self, count: int) -> None:
        with self._unstarted_lock:
            self._unstarted -= count

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          sink: OutputSink, prompt: str | None = None) -> None:
        """Queue one request whose outputs go to ``sink`` (see :meth:`add_requests`)."""
        await self.add_requests([NewRequest(request_id, list(prompt_token_ids), params, prompt)], sink)

    async def add_requests(self, requests: list[NewRequest], sink: OutputSink) -> None:
        """Queue ``requests`` (one per prompt of a call), all or none, their outputs going to ``sink``.

        Raises ValueError (a bad request, from the engine's validation; with several, the message names
        the prompt's index), :class:`QueueFullError` (the waiting bound cannot take them all) or
        :class:`EngineStoppedError`; nothing is queued then.
        """
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down")
        if self.max_waiting is not None and len(requests) > self.max_waiting:
            raise ValueError(f"{len(requests)} prompts in one request exceed the server's waiting bound "
                             f"(--max-waiting-requests {self.max_waiting})")
        self._reserve(len(requests))
        assert self._loop is not None
        answer = self._loop.create_future()
        self._post(("add", list(requests), sink, time.monotonic(), answer))
        try:
            await asyncio.shield(answer)
        except asyncio.CancelledError:
            for req in requests:  # the add may still land: take it back
                self.abort(req.request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request and free its cache (as soon as the engine thread sees it; unknown ids are ignored)."""
        self._post(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        """Evict every cached prefix no request holds, in the engine thread between steps; True if none is left."""
        assert self._loop is not None
        answer = self._loop.create_future()
        self._post(("reset_prefix_cache", answer))
        return await answer

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        while True:
            self._apply_commands()
            if self.kv_events is not None:
                self.kv_events(engine.take_kv_events())
            if self._stop:
                self._abort_everything()
                self._take_snapshot()
                engine.shutdown()  # tensor-parallel workers, if any
                return
            self._take_snapshot()
            if not engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except TensorParallelError as exc:  # a rank is gone: the engine is down, refuse everything from now on
                logger.error("the engine is down: %s", exc)
                self.down_reason = f"the engine is down: {exc}"
                self.accepting = False
                self._abort_everything(error=exc)
                self._take_snapshot()
                engine.shutdown()
                return
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                self._failures += 1
                pause = min(self.MAX_BACKOFF_S, 0.01 * 2 ** (self._failures - 1))
                logger.exception("engine step failed (%d in a row); failing the requests in flight, next step in "
                                 "%.2f s", self._failures, pause)
                self._abort_everything(error=exc)
                self._take_snapshot()
                self._stopping.wait(pause)  # new commands do not cut the pause short; shutdown does
                continue
            self._failures = 0
            now = time.monotonic()
            for out in outputs:
                self._deliver(out, now)
            self._count_started()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, requests, sink, arrival, answer = command
                try:
                    self.engine.add_requests([(r.request_id, r.prompt_token_ids, r.params, r.prompt)
                                              for r in requests])
                except Exception as exc:  # noqa: BLE001 - handed back to the caller
                    self._unreserve(len(requests))
                    self._call(_set_exception, answer, exc)
                    continue
                for r in requests:
                    self._tracked[r.request_id] = _Tracked(sink, arrival)
                    self._unstarted_ids.add(r.request_id)
                self._call(_set_result, answer, None)
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "abort_all":
                self._abort_everything()
            elif kind == "reset_prefix_cache":
                self._call(_set_result, command[1], self.engine.reset_prefix_cache())

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        self.engine.abort_request(request_id)
        self._mark_started(request_id)
        if tracked is not None:
            self._call(tracked.sink.put, _aborted_output(request_id, tracked.last))

    def _abort_everything(self, error: BaseException | None = None) -> None:
        for rid in list(self._tracked):
            tracked = self._tracked.pop(rid)
            self.engine.abort_request(rid)
            self._mark_started(rid)
            if error is not None:
                self._call(tracked.sink.fail, error)
            else:
                self._call(tracked.sink.put, _aborted_output(rid, tracked.last))
        self.engine.abort_all()

    def _mark_started(self, request_id: str) -> None:
        """``request_id`` no longer counts against the waiting bound (it started, ended or was aborted)."""
        if request_id in self._unstarted_ids:
            self._unstarted_ids.discard(request_id)
            self._unreserve(1)

    def _count_started(self) -> None:
        if self._unstarted_ids:
            for rid in [r for r in self._unstarted_ids if self.engine.has_started(r)]:
                self._mark_started(rid)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > tracked.num_tokens:
            if tracked.last_token_time is None:
                self.ttft.observe(now - tracked.arrival)
            else:
                self.itl.observe(now - tracked.last_token_time)
            tracked.num_tokens = num_tokens
            tracked.last_token_time = now
        tracked.last = out
        if out.finished:
            del self._tracked[out.request_id]
            self._mark_started(out.request_id)
            if out.error is None:
                self.num_requests_finished += 1
        if out.error is not None:
            self._call(tracked.sink.fail, RequestFailedError(out.request_id, out.error))
        else:
            self._call(tracked.sink.put, out)

    def _take_snapshot(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        self.snapshot = EngineSnapshot(
            num_requests_running=scheduler.num_running_requests(),
            num_requests_waiting=len(self._unstarted_ids),
            cache_usage=engine.cache.usage(),
            prompt_tokens=engine.stats["prompt_tokens"],
            generation_tokens=engine.stats["generation_tokens"],
            num_preemptions=scheduler.num_preemptions,
            prefix_cache=engine.prefix_cache_stats(),
            spec_decode=engine.spec_decode_stats(),
            cpu_threads=torch.get_num_threads(),
            cpu_thread_changes=engine.thread_share.changes if engine.thread_share is not None else 0,
        )

    def _call(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _aborted_output(request_id: str, last: RequestOutput | None) -> RequestOutput:
    """The final output of an aborted request: what it had produced, unfinished completions marked "abort"."""
    if last is None:
        return RequestOutput(request_id, None, [], None, [], finished=True)
    completions = [dataclasses.replace(c, finish_reason=c.finish_reason or "abort") for c in last.outputs]
    return dataclasses.replace(last, outputs=completions, finished=True)


__all__ = ["AsyncEngine", "EngineSnapshot", "EngineStoppedError", "NewRequest", "OutputSink", "QueueFullError",
           "RequestFailedError"]
