"""What a router asks of each replica: render (the token ids a request runs), load, cache flush."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import make_checkpoint, wait_for

KEY = "router-key"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp("router") / "bamba"))
    engine = LLMEngine(EngineConfig(model=path, cache_memory="8MiB", enable_progress_bar=False))
    state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                        model_name="bamba", max_model_len=engine.max_model_len, api_key=KEY)
    with TestClient(build_app(state), base_url="http://localhost",
                    headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_render_gives_the_tokens_the_request_runs(client):
    prompts = ["Hello world! How are you today?", "The quick brown fox"]
    r = client.post("/v1/completions/render", json={"model": "bamba", "prompt": prompts})
    assert r.status_code == 200, r.text
    rendered = r.json()
    tokens = [client.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    assert [p["token_ids"] for p in rendered] == tokens
    assert client.post("/v1/completions/render", json={"prompt": [5, 6, 7]}).json()[0]["token_ids"] == [5, 6, 7]
    assert all(p["model"] == "bamba" and p["request_id"].startswith("cmpl-") for p in rendered)
    done = client.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(tokens[0])

    messages = [{"role": "user", "content": "Hello world!"}]
    r = client.post("/v1/chat/completions/render", json={"messages": messages})
    assert r.status_code == 200, r.text
    chat = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()["tokens"]
    assert r.json()["token_ids"] == chat and r.json()["request_id"].startswith("chatcmpl-")


def test_render_refuses_what_the_route_refuses(client):
    assert client.post("/v1/completions/render", json={"model": "other", "prompt": "x"}).status_code == 404
    assert client.post("/v1/completions/render", json={"prompt": []}).status_code == 400
    assert client.post("/v1/chat/completions/render", json={"messages": []}).status_code == 400
    assert client.post("/v1/completions/render", json={"prompt": "x"},
                       headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_load_and_flush(client):
    assert client.get("/get_load").json() == {"load": 0, "num_requests_running": 0, "num_requests_waiting": 0}
    assert client.get("/get_load", headers={"Authorization": "Bearer wrong"}).status_code == 401
    prompt = "Once upon a time there was a small model that served many requests at once."
    client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert client.app.state.hybridserve.engine.engine.cache.prefix.num_cached_pages > 0
    for route in ("/flush_cache", "/reset_prefix_cache"):
        r = client.post(route)
        assert r.status_code == 200 and r.json() == {"cleared": True}
        assert client.app.state.hybridserve.engine.engine.cache.prefix.num_cached_pages == 0
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    wait_for(lambda: client.get("/get_load").json()["load"] == 0, what="the load to fall back to 0")
