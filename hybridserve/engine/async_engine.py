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
from dataclasses import dataclass
from typing import Any

from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.metrics import Histogram
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


class OutputSink:
    """Where one caller's outputs arrive: the latest output per request id, and a wake-up event.

    One sink may collect several engine requests (a completion with several prompts). Only the
    asyncio loop thread touches it.
    """

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    def put(self, output: RequestOutput) -> None:
        self._latest[output.request_id] = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def get(self, timeout: float | None = None) -> dict[str, RequestOutput]:
        """Wait for new outputs (at most ``timeout`` seconds; then ``{}``) and take them, by request id."""
        if not self._event.is_set():
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except asyncio.TimeoutError:
                return {}
        self._event.clear()
        if self._error is not None:
            raise self._error
        taken, self._latest = self._latest, {}
        return taken


@dataclass
class EngineSnapshot:
    """Gauges and counters as of the engine thread's last iteration (safe to read from any thread)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0


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

    ``max_waiting`` bounds the requests accepted but not yet running (``None``: no bound); past it,
    :meth:`add_request` raises :class:`QueueFullError`, so a flood of requests cannot grow memory
    without limit.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._pending_adds = 0  # asyncio thread only: adds posted, not yet answered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.accepting = False

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
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def abort_all(self) -> None:
        """Abort every request in flight (each caller gets its final, aborted output)."""
        self._post(("abort_all",))

    # ------------------------------------------------------------- requests
    def num_waiting(self) -> int:
        return self.snapshot.num_requests_waiting + self._pending_adds

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          sink: OutputSink, prompt: str | None = None) -> None:
        """Queue a request whose outputs go to ``sink``.

        Raises ValueError (bad request, from the engine's validation), :class:`QueueFullError` or
        :class:`EngineStoppedError`; nothing is queued then.
        """
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down")
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise QueueFullError(f"the server is busy: {self.num_waiting()} requests are already waiting "
                                 f"(the bound is {self.max_waiting}); retry later")
        assert self._loop is not None
        answer = self._loop.create_future()
        self._pending_adds += 1
        self._post(("add", request_id, list(prompt_token_ids), params, prompt, sink, time.monotonic(), answer))
        try:
            await asyncio.shield(answer)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still land: take it back
            raise
        finally:
            self._pending_adds -= 1

    def abort(self, request_id: str) -> None:
        """Abort a request and free its cache (as soon as the engine thread sees it; unknown ids are ignored)."""
        self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        while True:
            self._apply_commands()
            if self._stop:
                self._abort_everything()
                self._take_snapshot()
                return
            self._take_snapshot()
            if not engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                logger.exception("engine step failed; aborting the requests in flight")
                self._abort_everything(error=exc)
                continue
            now = time.monotonic()
            for out in outputs:
                self._deliver(out, now)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, rid, ids, params, prompt, sink, arrival, answer = command
                try:
                    self.engine.add_request(rid, ids, params, prompt=prompt)
                except Exception as exc:  # noqa: BLE001 - handed back to the caller
                    self._call(_set_exception, answer, exc)
                    continue
                self._tracked[rid] = _Tracked(sink, arrival)
                self._call(_set_result, answer, None)
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "abort_all":
                self._abort_everything()

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        self.engine.abort_request(request_id)
        if tracked is not None:
            self._call(tracked.sink.put, _aborted_output(request_id, tracked.last))

    def _abort_everything(self, error: BaseException | None = None) -> None:
        for rid in list(self._tracked):
            tracked = self._tracked.pop(rid)
            self.engine.abort_request(rid)
            if error is not None:
                self._call(tracked.sink.fail, error)
            else:
                self._call(tracked.sink.put, _aborted_output(rid, tracked.last))
        for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort_request(seq.request_id)

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
        self._call(tracked.sink.put, out)

    def _take_snapshot(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        self.snapshot = EngineSnapshot(
            num_requests_running=len({seq.request_id for seq in scheduler.running}),
            num_requests_waiting=len({seq.request_id for seq in scheduler.waiting}),
            cache_usage=engine.pool.usage(),
            prompt_tokens=engine.stats["prompt_tokens"],
            generation_tokens=engine.stats["generation_tokens"],
            num_preemptions=scheduler.num_preemptions,
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
