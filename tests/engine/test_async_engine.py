"""The engine thread behind the server: an exact waiting bound, all-or-none adds, a failing request
failing alone, and step failures that back off instead of spinning."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncEngine, NewRequest, OutputSink, QueueFullError, RequestFailedError
from hybridserve.engine.llm_engine import LLMEngine
from tests.checkpoints import make
from tests.faults import MARK, poison_marked_rows


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make(str(tmp_path_factory.mktemp("async")), "bamba")


def _engine(path: str, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, cache_memory="8MiB", enable_progress_bar=False, **options))


async def _collect(sink: OutputSink, ids: set[str]) -> dict:
    """Outputs of ``ids`` until all finished (raises what the sink raises)."""
    done: dict = {}
    while set(done) != ids:
        for rid, out in (await sink.get(timeout=30)).items():
            if out.finished:
                done[rid] = out
    return done


def _requests(prefix: str, count: int, params: SamplingParams) -> list[NewRequest]:
    return [NewRequest(f"{prefix}-{i}", [5 + i, 6, 7], params) for i in range(count)]


def test_waiting_bound_is_exact_and_adds_are_whole(path):
    """With one running sequence and a bound of 3, a call of 3 prompts fills the bound, a call that would
    pass it is refused whole, and the count returns to 0 once they have all started."""
    async def main():
        engine = AsyncEngine(_engine(path, max_num_seqs=1), max_waiting=3)
        engine.start()
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        with pytest.raises(ValueError, match="prompt 1: prompt token ids"):
            await engine.add_requests([NewRequest("d-0", [5], long), NewRequest("d-1", [10 ** 9], long)],
                                      OutputSink())
        assert engine.num_waiting() == 0  # the refused call holds no place
        sink = OutputSink()
        await engine.add_requests(_requests("a", 3, long), sink)
        assert engine.num_waiting() <= 3
        with pytest.raises(QueueFullError, match="bound is 3"):
            await engine.add_requests(_requests("b", 3, long), OutputSink())
        with pytest.raises(ValueError, match="4 prompts in one request exceed"):
            await engine.add_requests(_requests("c", 4, long), OutputSink())
        done = await _collect(sink, {"a-0", "a-1", "a-2"})
        assert all(len(o.outputs[0].token_ids) == 40 for o in done.values())
        assert engine.num_waiting() == 0
        await engine.shutdown()
        assert engine.engine.cache.usage() == 0 and not engine.engine.has_unfinished_requests()
    asyncio.run(main())


def test_a_failing_request_fails_only_its_caller(path, monkeypatch):
    poison_marked_rows(monkeypatch, float("nan"))

    async def main():
        engine = AsyncEngine(_engine(path), max_waiting=16)
        engine.start()
        good_sink, bad_sink = OutputSink(), OutputSink()
        good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        await engine.add_requests(_requests("good", 2, good), good_sink)
        await engine.add_requests([NewRequest("bad", [9, 9, 9], SamplingParams(temperature=MARK, max_tokens=12))],
                                  bad_sink)
        with pytest.raises(RequestFailedError) as failed:
            await _collect(bad_sink, {"bad"})
        assert failed.value.request_id == "bad" and "not finite" in failed.value.message
        done = await _collect(good_sink, {"good-0", "good-1"})
        assert all(o.error is None and len(o.outputs[0].token_ids) == 12 for o in done.values())
        await engine.shutdown()
        assert engine.engine.cache.usage() == 0 and engine.num_waiting() == 0
    asyncio.run(main())


def test_repeated_step_failures_back_off(path):
    """A step that always raises (a bug outside any one request) fails the requests in flight, and the
    engine thread pauses between failures (exponentially, up to MAX_BACKOFF_S) instead of spinning."""
    async def main():
        llm_engine = _engine(path)
        calls = []

        def broken_step(finished_only=False):
            calls.append(time.monotonic())
            raise RuntimeError("injected: step broken")

        llm_engine.step = broken_step
        engine = AsyncEngine(llm_engine, max_waiting=64)
        engine.start()
        params = SamplingParams(temperature=0, max_tokens=4)
        failures = 0
        start = time.monotonic()
        while time.monotonic() - start < 1.5:
            sink = OutputSink()
            await engine.add_requests([NewRequest(f"r{failures}", [5, 6], params)], sink)
            with pytest.raises(RuntimeError, match="step broken"):
                await _collect(sink, {f"r{failures}"})
            failures += 1
        await engine.shutdown()
        gaps = [b - a for a, b in zip(calls, calls[1:])]
        assert len(calls) < 40, f"{len(calls)} failing steps in 1.5 s: the engine thread spins"
        assert gaps and max(gaps) >= 0.1  # later failures wait longer
        assert llm_engine.cache.usage() == 0 and not llm_engine.has_unfinished_requests()
    asyncio.run(main())
