"""The OpenAI server over a TP-2 engine: a completion equals the TP-1 server's; a dead rank takes the engine
down (the request fails, ``/health`` answers 503 with the reason) instead of hanging."""

from __future__ import annotations

import os
import signal

from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig
from hybridserve.default_model import default_model_path
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker

BODY = {"model": "m", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}


def _client(tp: int) -> tuple[TestClient, LLMEngine]:
    path = default_model_path()
    engine = LLMEngine(EngineConfig(model=path, cache_memory="32MiB", enable_progress_bar=False,
                                    tensor_parallel_size=tp))
    state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                        model_name="m", max_model_len=engine.max_model_len)
    return TestClient(build_app(state), base_url="http://localhost"), engine


def test_tp2_server_matches_and_fails_cleanly():
    plain, _ = _client(1)
    with plain:
        expected = plain.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    client, engine = _client(2)
    with client:
        reply = client.post("/v1/completions", json=BODY)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
        worker = engine.tp.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        failed = client.post("/v1/completions", json=BODY)
        assert failed.status_code >= 500
        health = client.get("/health")
        assert health.status_code == 503 and "engine is down" in health.text and "rank 1" in health.text
    assert not any(p.is_alive() for p in engine.tp.processes)
