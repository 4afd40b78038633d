"""The server's side of generation_config.json and of unknown request fields: a request that leaves a sampling
field unset gets the model's default, one that sets it keeps its value; a field the API does not declare is a
400 naming it, while the OpenAI fields whose meaning here is "nothing to do" are accepted."""

from __future__ import annotations

import json
import os

import pytest
from fastapi.testclient import TestClient

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import make_checkpoint

PROMPT = "The quick brown fox"
#: greedy, a repetition "penalty" below 1 (the prompt's tokens favoured: a visible change), 3 tokens: none of them
#: the engine's default
GENERATION = {"do_sample": False, "repetition_penalty": 0.2, "max_new_tokens": 3}


def _client(path: str, **options) -> TestClient:
    engine = LLMEngine(EngineConfig(model=path, cache_memory="8MiB", enable_progress_bar=False, **options))
    state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                        model_name="bamba", max_model_len=engine.max_model_len)
    return TestClient(build_app(state), base_url="http://localhost")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp("gendefaults") / "bamba"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f)
    return path


@pytest.fixture(scope="module")
def client(ckpt):
    with _client(ckpt) as c:
        yield c


@pytest.fixture(scope="module")
def offline(ckpt):
    """The offline engine's texts for PROMPT: with the file's settings spelled out, and plain greedy."""
    llm = LLM(ckpt, generation_config="vllm", cache_memory="8MiB", enable_progress_bar=False)
    penalized, plain = llm.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0, repetition_penalty=0.2, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert penalized.outputs[0].token_ids != plain.outputs[0].token_ids  # so the penalty is seen
    return penalized.outputs[0].text, plain.outputs[0].text


def test_completions_take_the_model_defaults_unless_set(client, offline):
    penalized, plain = offline
    r = client.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["text"] == penalized
    r = client.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": 3,
                                             "repetition_penalty": 1.0})
    assert r.json()["choices"][0]["text"] == plain  # the request's value wins (greedy still from the file)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": 5})
    assert r.json()["usage"]["completion_tokens"] == 5


def test_chat_takes_the_model_defaults_unless_set(client):
    messages = [{"role": "user", "content": PROMPT}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    r = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True,
                                                  "max_completion_tokens": 4})
    assert r.json()["usage"]["completion_tokens"] == 4


def test_generation_config_vllm_ignores_the_file(ckpt):
    with _client(ckpt, generation_config="vllm") as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens of a completion


def test_a_second_eos_id_ends_a_reply_with_stop(tmp_path):
    """generation_config.json lists an end-of-turn id beside end-of-text: a reply that reaches it ends there with
    finish_reason "stop", streamed or not, and its text never shows it."""
    path = make_checkpoint(str(tmp_path / "bamba"))
    llm = LLM(path, cache_memory="8MiB", enable_progress_bar=False)
    eos, tok = llm.engine.eos_token_id, llm.get_tokenizer()
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    pos = next(i for i, t in enumerate(greedy.token_ids) if i >= 1 and t != eos and t not in greedy.token_ids[:i])
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos, greedy.token_ids[pos]]}, f)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with _client(path) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == pos + 1
        assert choice["text"] == tok.decode(greedy.token_ids[:pos])
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": True, "stream_options": {"bogus": True}},
     "stream_options.bogus"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                              "tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]},
     "tools.0.function.bogus"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "extra_key": 1}], "max_tokens": 1},
     "messages.0.extra_key"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                              "response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
])
def test_an_unknown_field_is_a_400_naming_it(client, route, body, field):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"] and "not supported" in error["message"]


def test_the_openai_no_op_fields_are_accepted_and_the_others_refused(client):
    messages = [{"role": "user", "content": "x"}]
    no_ops = {"user": "u-1", "metadata": {"k": "v"}, "safety_identifier": "s-1", "prompt_cache_key": "p-1",
              "store": False, "service_tier": "auto", "modalities": ["text"],
              "stream_options": {"include_usage": True, "include_obfuscation": False}}
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "stream": True, **no_ops})
    assert r.status_code == 200, r.text
    for field, value in [("store", True), ("service_tier", "priority"), ("modalities", ["text", "audio"]),
                         ("separate_reasoning", False), ("stream_reasoning", False), ("include_reasoning", False)]:
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


#: what vllm-router 0.1.17 adds to every request it forwards (captured from it), at its values
ROUTER_COMPLETION_FIELDS = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                            "return_hidden_states": False}
ROUTER_CHAT_FIELDS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                      "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False, "include_reasoning": True}


def test_what_vllm_router_forwards_is_accepted(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **ROUTER_COMPLETION_FIELDS})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                                                  **ROUTER_CHAT_FIELDS})
    assert r.status_code == 200, r.text
    for field in ("no_stop_trim", "return_hidden_states"):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: True})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_the_openai_sdk_sends_only_accepted_fields(client):
    """Every parameter of the SDK's completions.create, and the no-op ones of chat.completions.create, pass."""
    from openai import OpenAI

    sdk = OpenAI(base_url="http://localhost/v1", api_key="none", http_client=client, max_retries=0)
    done = sdk.completions.create(model="bamba", prompt=PROMPT, best_of=1, echo=False, frequency_penalty=0.1,
                                  logit_bias={"5": 1.0}, logprobs=1, max_tokens=2, n=1, presence_penalty=0.1,
                                  seed=1, stop=["\n\n"], temperature=0.5, top_p=0.9, user="u")
    assert done.usage.completion_tokens <= 2
    chat = sdk.chat.completions.create(model="bamba", messages=[{"role": "user", "content": PROMPT}],
                                       max_completion_tokens=2, logprobs=True, top_logprobs=1, metadata={"a": "b"},
                                       store=False, user="u", safety_identifier="s", prompt_cache_key="k",
                                       service_tier="default", modalities=["text"], seed=3,
                                       response_format={"type": "text"})
    assert chat.choices[0].finish_reason in ("stop", "length")
