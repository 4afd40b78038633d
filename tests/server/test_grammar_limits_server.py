"""Grammar compilation over the server (docs/structured_output.md, "Limits"): off the event loop (``/health``
answers while a big grammar compiles), within --max-grammar-compile-seconds (a 400 naming it past that), and once
per grammar (not once on the loop and again in the engine). Loopback only; every loop bounded in count and time."""

from __future__ import annotations

import threading
import time

import httpx
import llguidance
import pytest
from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig
from hybridserve.default_model import default_model_path
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import ServerProcess, idle, wait_for

MODEL = "default"
#: about 3 to 5 s to compile on a 2-core machine (the loop used to run a validation of it for ~3 s)
BIG_CHOICE = [f"c{i}x" for i in range(50000)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("grammar-limits") / "server.log"
    proc = ServerProcess(default_model_path(), str(log), "--served-model-name", MODEL, "--cache-memory", "32MiB",
                         "--max-grammar-compile-seconds", "0.5", "--max-grammar-bytes", "1000000")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def test_health_answers_while_a_big_grammar_compiles(server):
    answer: dict = {}

    def send() -> None:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "guided_choice": BIG_CHOICE}
        answer["response"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    sender = threading.Thread(target=send)
    started = time.monotonic()
    sender.start()
    latencies = []
    while sender.is_alive() and time.monotonic() - started < 30 and len(latencies) < 300:
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    sender.join(timeout=60)
    assert len(latencies) >= 3, latencies  # the request lasted long enough to poll /health meanwhile
    assert max(latencies) < 1.0, latencies
    response = answer["response"]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_choice"
    assert "--max-grammar-compile-seconds" in error["message"] and "0.5 s" in error["message"], error
    # the engine kept serving requests without a grammar meanwhile (the compile may still be running)
    plain = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                       timeout=30)
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: idle(server), what="an idle server")


class CountingMatcher:
    """``llguidance.LLMatcher``, counting grammar compilations: matchers built and grammars validated."""

    def __init__(self, real) -> None:
        self.real = real
        self.compiles = 0

    def __call__(self, *args, **kwargs):
        self.compiles += 1
        return self.real(*args, **kwargs)

    def validate_grammar(self, *args, **kwargs):
        self.compiles += 1
        return self.real.validate_grammar(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_a_grammar_is_compiled_once_per_request(monkeypatch):
    path = default_model_path()
    engine = LLMEngine(EngineConfig(model=path, cache_memory="32MiB", enable_progress_bar=False))
    state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                        model_name=MODEL, max_model_len=engine.max_model_len)
    counting = CountingMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "guided_regex": "(yes|no)!"}
    with TestClient(build_app(state)) as client:
        first = client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] in ("yes!", "no!")
        assert counting.compiles == 1
        again = client.post("/v1/chat/completions", json={**body, "n": 2})  # the same grammar: cached
        assert again.status_code == 200 and counting.compiles == 1
        other = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8,
                                                     "guided_choice": ["left", "right"]})
        assert other.status_code == 200 and other.json()["choices"][0]["text"] in ("left", "right")
        assert counting.compiles == 2
