"""Speculative decoding behind the OpenAI server: streamed and whole outputs equal a server without it, and
``/metrics`` exposes its counters and acceptance-length histogram with the engine's exact figures."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.config import EngineConfig
from hybridserve.default_model import default_model_path
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import wait_for

NGRAM = {"method": "ngram", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def clients():
    """In-process servers on the shipped model: ``plain`` and ``spec`` (n-gram drafts)."""
    path = default_model_path()
    opened = {}
    try:
        for name, spec in (("plain", None), ("spec", NGRAM)):
            engine = LLMEngine(EngineConfig(model=path, cache_memory="32MiB", enable_progress_bar=False,
                                            speculative_config=spec))
            state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                                model_name=name, max_model_len=engine.max_model_len)
            client = TestClient(build_app(state), base_url="http://localhost")
            client.__enter__()
            client.engine = engine  # the test reads the engine's own figures
            opened[name] = client
        yield opened
    finally:
        for client in opened.values():
            client.__exit__(None, None, None)


def _streamed_text(response) -> str:
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _samples(client: TestClient) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out[s.name + json.dumps({k: v for k, v in sorted(s.labels.items()) if k != "model_name"})] = s.value
    return out


@pytest.mark.parametrize("stop", [None, ["very much"]])
def test_streamed_and_whole_outputs_equal_a_server_without_speculation(clients, stop):
    body = {"prompt": "Once upon a time", "max_tokens": 120, "temperature": 0, "stop": stop}
    plain = clients["plain"].post("/v1/completions", json=body).json()["choices"][0]
    whole = clients["spec"].post("/v1/completions", json=body).json()["choices"][0]
    streamed = _streamed_text(clients["spec"].post("/v1/completions", json={**body, "stream": True}))
    assert whole["text"] == plain["text"] == streamed
    assert whole["finish_reason"] == plain["finish_reason"]


def test_n_greater_than_one_with_speculation(clients):
    body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "n": 2}
    plain = clients["plain"].post("/v1/completions", json=body).json()["choices"]
    spec = clients["spec"].post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in spec] == [c["text"] for c in plain]


def test_metrics_carry_the_engine_figures(clients):
    spec = clients["spec"]
    r = spec.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0})
    assert r.status_code == 200
    wait_for(lambda: _samples(spec).get('hybridserve:spec_decode_num_drafts_total{}', 0) > 0,
             what="the engine thread's snapshot")
    samples = _samples(spec)
    drafts = samples['hybridserve:spec_decode_num_drafts_total{}']
    proposed = samples['hybridserve:spec_decode_num_draft_tokens_total{}']
    accepted = samples['hybridserve:spec_decode_num_accepted_tokens_total{}']
    assert 0 < accepted <= proposed and drafts > 0
    assert samples['hybridserve:spec_decode_acceptance_length_count{}'] == drafts
    assert samples['hybridserve:spec_decode_acceptance_length_sum{}'] == accepted
    assert samples['hybridserve:spec_decode_acceptance_length_bucket{"le": "+Inf"}'] == drafts
    assert samples['hybridserve:spec_decode_acceptance_length_bucket{"le": "5.0"}'] == drafts
    stats = spec.engine.speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (drafts, proposed, accepted)
    plain = _samples(clients["plain"])
    assert not any(name.startswith("hybridserve:spec_decode") for name in plain)  # off: not exposed
