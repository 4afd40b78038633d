"""Structured output over the OpenAI-compatible server (the shipped default model, live on loopback, driven by
the ``openai`` client): ``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` fields, and 400s
naming the bad param. The schemas bound their strings and arrays, so every output completes (see
tests/structured_output/test_structured_output.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from hybridserve.default_model import default_model_path
from tests.server.server_utils import ServerProcess, idle, wait_for

MODEL = "default"
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 1800, "maximum": 1820},
        "characters": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}},
        "sequel": {"type": "object", "properties": {"exists": {"type": "boolean"}}, "required": ["exists"],
                   "additionalProperties": False},
    },
    "required": ["title", "year", "characters", "sequel"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a novel as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("so-server") / "server.log"
    # a compile limit well above the default 5 s: the over-a-limit cases below must meet llguidance's parser limits,
    # not the clock (a loaded 2-core machine took over 5 s to reach "too many expressions")
    proc = ServerProcess(default_model_path(), str(log), "--served-model-name", MODEL, "--cache-memory", "32MiB",
                         "--max-grammar-compile-seconds", "60")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_response_format_json_schema(client, server):
    for seed in range(4):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                              temperature=1.0, seed=seed, max_tokens=400)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), BOOK)
    wait_for(lambda: idle(server), what="an idle server")


def test_chat_stream_json_schema_equals_non_stream(client):
    kw = dict(model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT, temperature=1.0, seed=9,
              max_tokens=400)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), BOOK)


def test_completion_json_object_and_text(client):
    # the openai client's completions.create has no response_format argument: it goes in the body as is
    resp = client.completions.create(model=MODEL, prompt="Mr. Darcy", max_tokens=8, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    plain = client.completions.create(model=MODEL, prompt="Mr. Darcy", max_tokens=8, temperature=0)
    assert resp.choices[0].text == plain.choices[0].text  # "text" is no constraint
    obj = client.completions.create(model=MODEL, prompt="Mr. Darcy", max_tokens=16, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{")
    book = client.completions.create(model=MODEL, prompt="A novel:", max_tokens=400, temperature=1.0, seed=4,
                                     extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(book.choices[0].text), BOOK)


def test_guided_choice_and_structured_outputs(client):
    choices = ["Pemberley", "Netherfield", "Rosings"]
    resp = client.completions.create(model=MODEL, prompt="Where does he live?", max_tokens=20, n=5, temperature=1.0,
                                     seed=1, extra_body={"guided_choice": choices})
    assert {c.text for c in resp.choices} <= set(choices)
    assert {c.finish_reason for c in resp.choices} == {"stop"}
    pattern = r"[A-Z][a-z]{2,8} (Bennet|Darcy)"
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=2,
                                          extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, resp.choices[0].message.content)
    resp = client.completions.create(model=MODEL, prompt="A year:", max_tokens=40, temperature=1.0, seed=3,
                                     extra_body={"guided_json": {"type": "integer", "minimum": 1, "maximum": 9}})
    assert 1 <= json.loads(resp.choices[0].text) <= 9


@pytest.mark.parametrize("kw, param, problem", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}),
     "response_format", "objec"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "required"),
    (dict(response_format={"type": "yaml"}), "response_format", "json_schema"),
    (dict(extra_body={"guided_regex": "[a-"}), "guided_regex", "unclosed character class"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "non-empty"),
    (dict(extra_body={"guided_grammar": "start: nothing_here"}), "guided_grammar", "nothing_here"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "exactly one"),
    (dict(extra_body={"structured_outputs": {"pattern": "a"}}), "structured_outputs", "pattern"),
    (dict(extra_body={"guided_regex": "a+", "guided_choice": ["a"]}), "guided_choice", "only one"),
])
def test_bad_structured_output_is_400_naming_the_param(client, kw, param, problem):
    body = {**kw.get("extra_body", {}), **({"response_format": kw["response_format"]} if "response_format" in kw
                                            else {})}
    calls = [lambda: client.chat.completions.create(model=MODEL, max_tokens=4, messages=MESSAGES, **kw),
             lambda: client.completions.create(model=MODEL, max_tokens=4, prompt="Hello", extra_body=body)]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        error = info.value.body
        assert error["param"] == param and problem in error["message"], error


RECURSIVE_REQUIRED = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                          "required": ["x"]}}}


@pytest.mark.parametrize("body, param, limit", [
    ({"guided_regex": "a{1000000}"}, "guided_regex", "too many expressions"),
    ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs", "too many expressions"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE_REQUIRED}}},
     "response_format", "limit 50000"),
    ({"guided_json": {"anyOf": [{"const": [i]} for i in range(3000)]}}, "guided_json", "max is 2000"),
    ({"guided_choice": [f"choice number {i}" for i in range(5000)]}, "guided_choice", "--max-grammar-bytes"),
])
def test_grammar_over_a_limit_is_400_naming_it(client, server, body, param, limit):
    """Grammars over llguidance's parser limits (which used to fail at the first token with a 500) and over
    --max-grammar-bytes: refused before anything is queued."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, max_tokens=4, prompt="Hello", extra_body=body)
    error = info.value.body
    assert error["param"] == param and limit in error["message"], error
    assert "limit" in error["message"]
    wait_for(lambda: idle(server), what="an idle server")
