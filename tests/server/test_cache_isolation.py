"""Issue 33, isolation: ``cache_salt`` on the completion and chat routes, ``--prefix-cache-isolation api-key``, and
the KV events' sockets on loopback unless ``--kv-events-allow-remote``. On the real app, in process, over a tiny
Bamba checkpoint with a trained tokenizer."""

from __future__ import annotations

import contextlib
import logging

import pytest
from fastapi.testclient import TestClient

from hybridserve.cache.kv_events import BlockStored
from hybridserve.cache.salt import MAX_CACHE_SALT_CHARS
from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.cache_isolation import check_isolation, request_cache_salt
from hybridserve.entrypoints.openai.kv_events import (
    KVEventsConfig,
    ZmqEventPublisher,
    check_exposure,
    is_loopback_endpoint,
)
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import free_port, make_checkpoint

KEY = "iso-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFIX = list(range(40, 80))  # 40 shared prompt tokens
SECRET = 201


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("iso") / "bamba"))


@contextlib.contextmanager
def _client(path: str, isolation: str = "shared", events: list | None = None):
    """The app over a fresh engine; with ``events``, the KV events it publishes are appended there."""
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_memory="8MiB", max_model_len=128,
                                    max_num_seqs=2, enable_progress_bar=False))
    if events is not None:
        engine.enable_kv_events()
    state = ServerState(engine=AsyncEngine(engine, kv_events=None if events is None else events.extend),
                        tokenizer=TokenizerWorker(path, engine.max_model_len),
                        model_name="tiny", max_model_len=engine.max_model_len, api_key=KEY,
                        prefix_cache_isolation=isolation)
    with TestClient(build_app(state), base_url="http://localhost") as client:
        yield client, engine


@pytest.fixture
def client(checkpoint):
    with _client(checkpoint) as (client, _):
        yield client


def _cached(client: TestClient, prompt: list[int], salt: str | None = None, chat: bool = False) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of one greedy request."""
    body = {"model": "tiny", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    if chat:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": " ".join(map(str, prompt))}]
    else:
        route, body["prompt"] = "/v1/completions", prompt
    r = client.post(route, json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _probe(client: TestClient, victim_salt: str | None, attacker_salt: str | None, victim: bool) -> list:
    """Finding 1's oracle, on an emptied cache: the victim's request (if ``victim``), then each guess of its secret
    sent twice by the attacker; the cached tokens of every send."""
    assert client.post("/reset_prefix_cache", headers=AUTH).status_code == 200
    if victim:
        _cached(client, PREFIX + [SECRET, 9, 9, 9, 9, 9, 9], victim_salt)
    return [(_cached(client, PREFIX + [guess, 7, 8], attacker_salt),
             _cached(client, PREFIX + [guess, 7, 8], attacker_salt)) for guess in (SECRET + 1, SECRET)]


def test_the_cached_tokens_oracle_gives_nothing_across_salts(client):
    """What the attacker sees with the victim's request cached is what it sees without it, unless they share a
    salt (the control: there the secret shows)."""
    for victim_salt, attacker_salt, leaks in [("t", "t", True), ("victim", "attacker", False),
                                              ("victim", None, False), (None, "attacker", False)]:
        seen = _probe(client, victim_salt, attacker_salt, victim=True)
        alone = _probe(client, victim_salt, attacker_salt, victim=False)
        assert (seen != alone) == leaks, (victim_salt, attacker_salt, seen, alone)


def test_one_salt_shares_and_chat_takes_a_salt(client):
    prompts = [PREFIX + [i, 5, 6] for i in (1, 2, 3)]
    assert [_cached(client, p, "a") for p in prompts][2] >= len(PREFIX)  # the second's branch point
    assert _cached(client, prompts[2], "b") == 0
    assert _cached(client, prompts[2]) == 0
    text = list(range(3, 30))
    assert [_cached(client, text, "a", chat=True) for _ in range(3)][2] > 0
    assert _cached(client, text, "b", chat=True) == 0


@pytest.mark.parametrize("salt, words", [("", ["cache_salt", "empty"]), (12, ["cache_salt", "string"]),
                                         ("s" * (MAX_CACHE_SALT_CHARS + 1), ["cache_salt", str(MAX_CACHE_SALT_CHARS)])])
def test_a_bad_salt_is_a_400_naming_the_rule(client, salt, words):
    for route, body in [("/v1/completions", {"prompt": [5, 6]}), ("/v1/chat/completions",
                                                                 {"messages": [{"role": "user", "content": "hi"}]})]:
        r = client.post(route, json={**body, "max_tokens": 1, "cache_salt": salt}, headers=AUTH)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert all(word in error["message"] for word in words) and error["param"] == "cache_salt"


def test_api_key_isolation_keys_every_request_by_its_key(checkpoint):
    with _client(checkpoint, isolation="api-key") as (client, engine):
        prompts = [PREFIX + [i, 5, 6] for i in (1, 2, 3)]
        assert [_cached(client, p) for p in prompts][2] >= len(PREFIX)  # requests with one key share
        assert _cached(client, prompts[2], "own") == 0  # a client salt separates within the key
        index = engine.cache.prefix.index
        assert not index.root.children and not index.root.snapshots  # nothing in the unsalted tree
        assert index.num_salts == 2
        assert index.root_of(request_cache_salt("api-key", None, f"Bearer {KEY}")).children
    # two keys never share, nor a key and a client salt, nor a key's client salt and another key's
    salts = {request_cache_salt("api-key", salt, f"Bearer {key}") for key in ("k1", "k2") for salt in (None, "s")}
    assert len(salts) == 4 and not salts & {None, "s", "k1", "k2"}
    assert request_cache_salt("shared", "s", f"Bearer {KEY}") == "s"
    assert request_cache_salt("api-key", "s", "Bearer k1") == request_cache_salt("api-key", "s", "bearer  k1")
    with pytest.raises(ValueError, match="--prefix-cache-isolation=api-key needs --api-key"):
        check_isolation("api-key", None)


def test_salted_requests_publish_no_kv_events(checkpoint):
    prompt = PREFIX + [1, 2, 3]
    for isolation, salt, published in [("shared", None, True), ("shared", "tenant", False), ("api-key", None, False)]:
        events: list = []
        with _client(checkpoint, isolation, events) as (client, _):
            _cached(client, prompt, salt)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert bool(stored) == published, (isolation, salt)
        assert all(set(e.token_ids) <= set(prompt) for e in stored)


def test_kv_events_default_to_loopback():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert config.endpoint == "tcp://127.0.0.1:5557" and is_loopback_endpoint(config.endpoint)
    assert check_exposure(config, allow_remote=False) == []
    for endpoint in ("tcp://127.0.0.1:1", "tcp://[::1]:1", "tcp://localhost:1", "ipc:///tmp/kv"):
        assert is_loopback_endpoint(endpoint), endpoint
    for endpoint in ("tcp://*:1", "tcp://0.0.0.0:1", "tcp://eth0:1", "tcp://10.0.0.1:1", "tcp://[::]:1",
                     "epgm://eth0;239.0.0.1:1", "tcp://127.0.0.1;10.0.0.1:1", "nonsense"):
        assert not is_loopback_endpoint(endpoint), endpoint


@pytest.mark.parametrize("where", ["endpoint", "replay_endpoint"])
def test_an_endpoint_beyond_loopback_needs_the_flag(where, caplog):
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, **{where: f"tcp://*:{port}"})
    with pytest.raises(ValueError, match=r"tcp://\*:\d+ is not a loopback endpoint.*--kv-events-allow-remote"):
        ZmqEventPublisher(config)  # refused before anything binds
    with caplog.at_level(logging.WARNING, logger="hybridserve.entrypoints.openai.kv_events"):
        assert check_exposure(config, allow_remote=True) == [f"tcp://*:{port}"]
    assert "every unsalted prompt's token ids" in caplog.text and "without authentication" in caplog.text


def test_serve_refuses_a_wildcard_kv_events_endpoint_before_loading(capsys):
    from hybridserve.entrypoints.cli import main

    flags = ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}']
    assert main(["serve", "/nonexistent-model-dir", *flags]) == 2
    assert "--kv-events-allow-remote" in capsys.readouterr().err
    assert main(["serve", "/nonexistent-model-dir", "--prefix-cache-isolation", "api-key"]) == 2
    assert "needs --api-key" in capsys.readouterr().err
