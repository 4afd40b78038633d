"""Tool calls over the OpenAI-compatible server with real clients (the ``openai`` SDK and LangChain's
``ChatOpenAI``) on tiny random checkpoints whose chat templates render tools (tests/server/tool_checkpoint.py).
``tool_choice`` required or named is enforced by the grammar, so even random weights give parseable calls whose
arguments satisfy the schemas; bad tool definitions are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.server_utils import ServerProcess, idle, wait_for
from tests.server.tool_checkpoint import GRANITE_TEMPLATE, HERMES_TEMPLATE, make_tool_checkpoint

LOOKUP = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup_weather", "description": "Weather in a city",
                                           "parameters": LOOKUP, "strict": True}},
         {"type": "function", "function": {"name": "count", "parameters": COUNT}}]
SCHEMAS = {"lookup_weather": LOOKUP, "count": COUNT}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _start(tmp_path_factory, name: str, template: str, *args: str, special: bool = False) -> ServerProcess:
    root = tmp_path_factory.mktemp(name)
    model = make_tool_checkpoint(str(root / "model"), template, special)
    proc = ServerProcess(model, str(root / "server.log"), "--served-model-name", "m", "--cache-memory", "32MiB", *args)
    proc.wait_healthy()
    return proc


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    proc = _start(tmp_path_factory, "hermes", HERMES_TEMPLATE, "--tool-call-parser", "hermes",
                  "--reasoning-parser", "think", "--max-grammar-bytes", "1000")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(hermes) -> openai.OpenAI:
    return openai.OpenAI(base_url=hermes.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "count"}}])
def test_forced_tool_calls_parse_and_satisfy_the_schema(client, choice):
    for seed in range(3):
        resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              parallel_tool_calls=False, temperature=1.0, seed=seed,
                                              max_tokens=80)
        choice_ = resp.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        assert len(choice_.message.tool_calls) == 1
        _check_calls(choice_.message.tool_calls, ["count"] if isinstance(choice, dict) else None)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup_weather"}}])
def test_streamed_tool_calls_add_up_to_the_unstreamed_reply(client, choice):
    kw = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
              temperature=1.0, seed=7, max_tokens=80)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    pieces = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    first = pieces[0]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name
    assert len(pieces) >= 2, "the arguments came in one piece with the name"
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert first.function.name == whole.message.tool_calls[0].function.name
    assert arguments == whole.message.tool_calls[0].function.arguments
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


def test_auto_reply_is_content_or_calls_never_lost(client):
    """``auto``: whatever the random model writes is content or parsed calls (or both), never dropped."""
    resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1,
                                          max_tokens=20)
    message = resp.choices[0].message
    assert message.content or message.tool_calls
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_agent_loop_feeds_tool_results_back(client, hermes):
    """A few turns: each call's result goes back as a ``role: "tool"`` message; the prompt grows and its start
    is served from the prefix cache."""
    messages = list(MESSAGES)
    cached = []
    for turn in range(3):
        resp = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=0.0, max_tokens=80)
        msg = resp.choices[0].message
        _check_calls(msg.tool_calls)
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [tc.model_dump() for tc in msg.tool_calls]})
        for tc in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"turn": turn, "ok": 1})})
    assert cached[-1] > 0, cached
    wait_for(lambda: idle(hermes), what="an idle server")


def test_langchain_bind_tools_returns_tool_calls(hermes):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=hermes.url + "/v1", api_key="unused", model="m", max_retries=0, timeout=60,
                     temperature=0.0, max_tokens=80)
    bound = llm.bind_tools(TOOLS, tool_choice="count")
    history = [HumanMessage("Count something.")]
    reply = bound.invoke(history)
    assert [c["name"] for c in reply.tool_calls] == ["count"]
    jsonschema.validate(reply.tool_calls[0]["args"], COUNT)
    streamed = None
    for chunk in bound.stream(history):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["count"]
    history += [reply, ToolMessage(content="3", tool_call_id=reply.tool_calls[0]["id"])]
    again = llm.bind_tools(TOOLS, tool_choice="any").invoke(history)
    assert again.tool_calls and again.tool_calls[0]["name"] in SCHEMAS


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_forced_call_or_json(client, hermes, stream):
    """With the template opening <think>, the output begins inside the reasoning; a strong bias on </think> ends
    it at once, and the grammar then forces the call (or the JSON of response_format). Streamed, the reasoning
    and the call come as their own deltas."""
    ids = httpx.post(hermes.url + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    assert len(ids) == 1
    common = dict(model="m", messages=MESSAGES, max_tokens=80, temperature=0.0, logit_bias={str(ids[0]): 100},
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    fmt = {"type": "json_schema", "json_schema": {"name": "count", "schema": COUNT}}
    for kw in (dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), dict(response_format=fmt)):
        if not stream:
            msg = client.chat.completions.create(**common, **kw).choices[0].message
            reasoning, content, calls = msg.reasoning_content, msg.content, msg.tool_calls
        else:
            deltas = [c.delta for ch in client.chat.completions.create(stream=True, **common, **kw)
                      for c in ch.choices]
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
            content = "".join(d.content or "" for d in deltas)
            calls = None
            if "tools" in kw:
                pieces = [tc for d in deltas for tc in (d.tool_calls or [])]
                assert pieces[0].function.name in SCHEMAS
                jsonschema.validate(json.loads("".join(p.function.arguments or "" for p in pieces)),
                                    SCHEMAS[pieces[0].function.name])
        assert reasoning == ""
        if "tools" in kw and calls is not None:
            _check_calls(calls)
        elif "tools" not in kw:
            jsonschema.validate(json.loads(content), COUNT)


BAD = [
    ({"tools": [{"type": "function", "function": {"parameters": LOOKUP}}]}, "tools[0].function.name", "required"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "not valid"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": TOOLS + [TOOLS[1]]}, "tools[2].function.name", "duplicate"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only tool type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be used together"),
    ({"messages": [{"role": "tool", "content": "x"}], "tools": TOOLS}, "messages[0].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
]


@pytest.mark.parametrize("extra,param,problem", BAD)
def test_bad_tool_requests_are_400_naming_the_field(hermes, extra, param, problem):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(hermes.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and problem in error["message"], error


def _wide_schema(fields: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(fields)}}


def test_tool_grammar_over_the_grammar_limit_is_400_naming_it(hermes):
    """Each tool's schema (checked even with ``auto``) and a forced call's whole grammar are within
    --max-grammar-bytes (1000 on this server)."""
    assert len(json.dumps(_wide_schema(20))) < 1000 < len(json.dumps(_wide_schema(40)))
    two = [{"type": "function", "function": {"name": name, "parameters": _wide_schema(20)}} for name in "ab"]
    for extra, param in [({"tools": two, "tool_choice": "required"}, "tools"),
                         ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _wide_schema(40)}}]},
                          "tools[0].function.parameters")]:
        r = httpx.post(hermes.url + "/v1/chat/completions", timeout=30,
                       json={"model": "m", "messages": MESSAGES, "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "--max-grammar-bytes" in error["message"], error


def test_granite_format_streamed_and_not(tmp_path_factory):
    """Granite's format, its tags special tokens (decoding keeps them for the parser; EOS text is dropped)."""
    proc = _start(tmp_path_factory, "granite", GRANITE_TEMPLATE, "--tool-call-parser", "granite", special=True)
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3,
                  max_tokens=120)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls"
        _check_calls(whole.message.tool_calls)
        plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=1)
        assert "<|" not in (plain.choices[0].message.content or "")  # no tools: special tokens skipped as before
        pieces = [tc for ch in client.chat.completions.create(stream=True, **kw) for c in ch.choices
                  for tc in (c.delta.tool_calls or [])]
        names = [p.function.name for p in pieces if p.id]
        assert names == [c.function.name for c in whole.message.tool_calls]
        for i, call in enumerate(whole.message.tool_calls):
            assert "".join(p.function.arguments or "" for p in pieces if p.index == i) == call.function.arguments
    finally:
        proc.stop()


def test_tool_choice_none_neither_renders_nor_parses_tools(hermes):
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    r = httpx.post(hermes.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == [], r.text
    rendered = httpx.post(hermes.url + "/v1/chat/completions/render", json=body, timeout=30).json()
    with_tools = httpx.post(hermes.url + "/v1/chat/completions/render", timeout=30,
                            json={**body, "tool_choice": "auto"}).json()
    assert len(rendered["token_ids"]) < len(with_tools["token_ids"])
