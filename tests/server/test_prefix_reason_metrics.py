"""The prefix cache's answer on the server: ``usage.prompt_tokens_details.prefix_cache_reason`` per request and
``hybridserve:prefix_cache_lookups_total{reason=...}`` / ``prefix_cache_queries_total{reason=...}`` on
``/metrics``; a match under another ``cache_salt`` is never told to the request (nor shown on an open
``/metrics``), and is shown as ``salted`` only on a ``/metrics`` that needs the API key."""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import make_checkpoint, wait_for

KEY = "test-key-1234"
PROMPT = [random.Random(0).randrange(3, 120) for _ in range(40)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """An open server and one whose /metrics needs the key, each on an engine of its own."""
    path = make_checkpoint(str(tmp_path_factory.mktemp("reasons") / "bamba"))
    opened = {}
    try:
        for name, key in (("open", None), ("protected", KEY)):
            engine = LLMEngine(EngineConfig(model=path, cache_memory="8MiB", enable_progress_bar=False))
            state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                                model_name=name, max_model_len=engine.max_model_len, api_key=key,
                                protect_metrics_and_docs=key is not None)
            client = TestClient(build_app(state), base_url="http://localhost")
            client.__enter__()
            if key is not None:
                client.headers["Authorization"] = f"Bearer {key}"
            opened[name] = client
        yield opened
    finally:
        for client in opened.values():
            client.__exit__(None, None, None)


def _complete(client: TestClient, prompt: list[int], salt: str) -> dict:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                                             "cache_salt": salt})
    assert r.status_code == 200, r.text
    return r.json()


def _lookups(client: TestClient) -> dict[str, float]:
    """``prefix_cache_lookups_total`` by reason (labels read from the text exposition)."""
    counts = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("hybridserve:prefix_cache_lookups_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.parametrize("name", ["open", "protected"])
def test_reasons_counted_and_salted_never_told(servers, name):
    client = servers[name]
    wait_for(lambda: bool(_lookups(client)), what="the engine's first snapshot")
    before = _lookups(client)
    first = _complete(client, PROMPT, "tenant-a")
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "prefix_cache_reason": "no_match"}
    same_salt = _complete(client, PROMPT + [5, 6], "tenant-a")
    assert same_salt["usage"]["prompt_tokens_details"] == {"cached_tokens": 40, "prefix_cache_reason": "hit"}
    r = client.post("/v1/completions", json={"prompt": PROMPT + [7, 8], "max_tokens": 2, "ignore_eos": True,
                                             "cache_salt": "tenant-b"})
    assert r.status_code == 200 and "salted" not in r.text  # told exactly what an empty cache would tell
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "prefix_cache_reason": "no_match"}
    after = _lookups(client)
    moved = {reason: after[reason] - before.get(reason, 0) for reason in after if after[reason] != before.get(reason)}
    if name == "protected":  # the key's holders see the lookup that matched only under another salt
        assert moved == {"no_match": 1, "hit": 1, "salted": 1}
    else:  # an open /metrics counts it as what the request was told
        assert moved == {"no_match": 2, "hit": 1} and "salted" not in after
