"""One bad request never harms another: each bad request gets its own clean 4xx, the good requests in
flight beside it complete normally, and afterwards nothing runs, nothing waits and the cache is empty.

One server for the module (``guarded``): a tiny Bamba whose chat template raises on a message
"RAISE", with an API key that also protects /metrics and the docs, small per-request limits, four
running sequences, and no --served-model-name (so its name is the checkpoint directory's).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from typing import Any, Awaitable, Callable
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.server_utils import RAISING_CHAT_TEMPLATE, ServerProcess, idle, make_checkpoint, wait_for

API_KEY = "guard-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CKPT_NAME = "bamba-guarded"
MAX_MODEL_LEN = 256
MAX_PROMPTS, MAX_COMPLETIONS, MAX_STOP, MAX_STOP_LEN, MAX_MESSAGES = 16, 32, 4, 32, 64
BODY_LIMIT = 2 ** 20
#: the loose bound on a stream's inter-token gap and on /health while another client sends a huge body
RESPONSIVE_S = 2.0


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    root = tmp_path_factory.mktemp("guarded")
    ckpt = make_checkpoint(str(root / CKPT_NAME), RAISING_CHAT_TEMPLATE)
    proc = ServerProcess(ckpt, str(root / "server.log"), "--protect-metrics-and-docs",
                         "--max-model-len", str(MAX_MODEL_LEN), "--cache-memory", "32MiB", "--max-num-seqs", "4",
                         "--max-waiting-requests", "64", "--max-request-body-size", "1MiB",
                         "--max-prompts-per-request", str(MAX_PROMPTS),
                         "--max-completions-per-request", str(MAX_COMPLETIONS),
                         "--max-stop-strings", str(MAX_STOP), "--max-stop-string-length", str(MAX_STOP_LEN),
                         "--max-chat-messages", str(MAX_MESSAGES), api_key=API_KEY)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def assert_idle(server: ServerProcess) -> None:
    wait_for(lambda: idle(server), timeout=10.0, what="0 running, 0 waiting, cache usage 0")


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in error["message"]
    return error


# ------------------------------------------------------------------------------------ good traffic
class Stream:
    """What a good streaming request saw: finish reasons, tokens, error events, the longest gap between chunks."""

    def __init__(self) -> None:
        self.finish: str | None = None
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.errors: list[dict] = []
        self.max_gap = 0.0
        self.started = asyncio.Event()


async def good_stream(client: httpx.AsyncClient, i: int, max_tokens: int, out: Stream, **extra: Any) -> Stream:
    body = {"prompt": f"Good request {i}: once upon a time", "max_tokens": max_tokens, "temperature": 0.8,
            "seed": i, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            out.max_gap = max(out.max_gap, now - last) if last is not None else 0.0
            last = now
            out.started.set()
            event = json.loads(line[len("data: "):])
            if "error" in event:
                out.errors.append(event["error"])
                continue
            for c in event["choices"]:
                out.finish = c["finish_reason"] or out.finish
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
                out.prompt_tokens = event["usage"]["prompt_tokens"]
    return out


async def beside_good_streams(server: ServerProcess, bad: Callable[[httpx.AsyncClient], Awaitable[Any]],
                              num_good: int = 3, max_tokens: int = 48, **extra: Any) -> tuple[Any, list[Stream]]:
    """Run ``bad`` while ``num_good`` streams are generating; check that every stream completed normally."""
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
        streams = [Stream() for _ in range(num_good)]
        tasks = [asyncio.create_task(good_stream(client, i, max_tokens, s, **extra)) for i, s in enumerate(streams)]
        await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
        result = await bad(client)
        await asyncio.gather(*tasks)
    for s in streams:
        assert (s.finish, s.completion_tokens, s.errors) == ("length", max_tokens, []), vars(s)
    return result, streams


def run_beside_good_streams(server: ServerProcess, bad, queues_nothing: bool = True, **kw) -> Any:
    """``bad``'s result, after checking the good streams beside it and that the server is idle; with
    ``queues_nothing``, also that the engine took no prompt but the good streams' (the bad were refused whole)."""
    before = server.metrics()["hybridserve:prompt_tokens_total"]
    result, streams = asyncio.run(beside_good_streams(server, bad, **kw))
    assert_idle(server)
    if queues_nothing:
        after = server.metrics()["hybridserve:prompt_tokens_total"]
        assert after - before == sum(s.prompt_tokens for s in streams)
    return result


def post(path: str, body: dict | bytes) -> Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]:
    async def call(client: httpx.AsyncClient) -> httpx.Response:
        if isinstance(body, bytes):
            return await client.post(path, content=body, headers={"Content-Type": "application/json"})
        return await client.post(path, json=body)
    return call


def many(*calls) -> Callable[[httpx.AsyncClient], Awaitable[list[httpx.Response]]]:
    async def call(client: httpx.AsyncClient) -> list[httpx.Response]:
        return list(await asyncio.gather(*(c(client) for c in calls)))
    return call


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(content: str = "Hello", **kw: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


# ------------------------------------------------------------------------------------------- seeds
def test_seed_out_of_range_with_n_is_400(guarded):
    bad = many(post(COMPLETIONS, {"prompt": "Hi", "max_tokens": 5, "n": 3, "seed": 18446744073709551614}),
               post(CHAT, chat_body(n=3, seed=18446744073709551614)),
               post(COMPLETIONS, {"prompt": "Hi", "max_tokens": 5, "seed": 2 ** 64}),
               post(COMPLETIONS, {"prompt": "Hi", "max_tokens": 5, "seed": -(2 ** 63) - 1}))
    responses = run_beside_good_streams(guarded, bad)
    for r in responses:
        error = error_of(r, 400)
        assert error["param"] == "seed" and "seed=" in error["message"], error
    assert "18446744073709551613" in responses[0].json()["error"]["message"]  # the range for n=3
    assert str(2 ** 64 - 1) in responses[2].json()["error"]["message"]
    # the largest valid seed works
    r = httpx.post(guarded.url + COMPLETIONS, headers=AUTH,
                   json={"prompt": "Hi", "max_tokens": 3, "n": 3, "seed": 2 ** 64 - 3, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert_idle(guarded)


# ------------------------------------------------------------------------------------ temperatures
def test_tiny_temperature_is_greedy(guarded):
    base = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    greedy = httpx.post(guarded.url + COMPLETIONS, headers=AUTH, json={**base, "temperature": 0}).json()
    bad = many(post(COMPLETIONS, {**base, "temperature": 1e-40}), post(COMPLETIONS, {**base, "temperature": 1e-38}),
               post(CHAT, chat_body(temperature=1e-40)))
    tiny, tinier, chat = run_beside_good_streams(guarded, bad, queues_nothing=False)
    for r in (tiny, tinier, chat):
        assert r.status_code == 200, r.text
    assert tiny.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert tinier.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    # tiny-temperature streams, side by side with normal ones, all end with a finish reason
    _, streams = asyncio.run(beside_good_streams(guarded, post(COMPLETIONS, {**base, "temperature": 1e-40}),
                                                 temperature=1e-40))
    assert all(s.finish == "length" for s in streams)
    assert_idle(guarded)


# ------------------------------------------------------------------------------------- work bounds
def test_prompt_and_completion_counts_are_bounded(guarded):
    bad = many(post(COMPLETIONS, {"prompt": ["Hi"] * (MAX_PROMPTS + 1), "max_tokens": 4}),
               post(COMPLETIONS, {"prompt": ["Hi"] * 20000, "max_tokens": 4}),
               post(COMPLETIONS, {"prompt": [[5, 6]] * 20000, "max_tokens": 4}),
               post(COMPLETIONS, {"prompt": ["Hi"] * MAX_PROMPTS, "n": 3, "max_tokens": 4}),
               post(COMPLETIONS, {"prompt": "Hi", "n": 129, "max_tokens": 4}),
               post(CHAT, chat_body(n=MAX_COMPLETIONS + 1)))
    r_prompts, r_20k, r_ids, r_n_prompts, r_n, r_chat_n = run_beside_good_streams(guarded, bad)
    for r in (r_prompts, r_20k, r_ids):
        error = error_of(r, 400)
        assert error["param"] == "prompt" and "--max-prompts-per-request" in error["message"]
        assert f"{MAX_PROMPTS:,}" in error["message"]
    assert "20,000 prompts" in r_20k.json()["error"]["message"]
    error = error_of(r_n_prompts, 400)
    assert error["param"] == "n" and "--max-completions-per-request" in error["message"]
    assert "--max-n" in error_of(r_n, 400)["message"]
    assert "--max-completions-per-request" in error_of(r_chat_n, 400)["message"]


def test_stop_strings_are_bounded(guarded):
    bad = many(post(COMPLETIONS, {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}),
               post(COMPLETIONS, {"prompt": "Hi", "stop": ["x" * (MAX_STOP_LEN + 1)]}),
               post(CHAT, chat_body(stop="y" * 10000)),
               post(COMPLETIONS, {"prompt": "Hi", "stop": [f"s{i}" for i in range(10000)], "n": 16}),
               post(COMPLETIONS, {"prompt": "Hi", "stop_token_ids": list(range(300))}))
    many_stops, long_stop, long_chat_stop, ten_k, stop_ids = run_beside_good_streams(guarded, bad)
    assert "--max-stop-strings" in error_of(many_stops, 400)["message"]
    assert "--max-stop-strings" in error_of(ten_k, 400)["message"]
    for r in (long_stop, long_chat_stop):
        error = error_of(r, 400)
        assert error["param"] == "stop" and "--max-stop-string-length" in error["message"], error
    assert "--max-stop-token-ids" in error_of(stop_ids, 400)["message"]


def test_empty_stop_string_is_400(guarded):
    bad = many(post(COMPLETIONS, {"prompt": "Hi", "stop": ""}), post(COMPLETIONS, {"prompt": "Hi", "stop": ["a", ""]}),
               post(CHAT, chat_body(stop="")))
    for r in run_beside_good_streams(guarded, bad):
        assert error_of(r, 400)["param"] == "stop"
    ok = httpx.post(guarded.url + COMPLETIONS, headers=AUTH, json={"prompt": "Hi", "max_tokens": 2, "stop": []})
    assert ok.status_code == 200


def test_booleans_are_not_token_ids(guarded):
    bad = many(post(COMPLETIONS, {"prompt": [True, False]}), post(COMPLETIONS, {"prompt": [[5, True]]}),
               post(COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [True]}),
               post(COMPLETIONS, {"prompt": "Hi", "n": True}), post(COMPLETIONS, {"prompt": "Hi", "max_tokens": True}))
    params = [error_of(r, 400)["param"] for r in run_beside_good_streams(guarded, bad)]
    assert params == ["prompt", "prompt", "stop_token_ids", "n", "max_tokens"]
    ok = httpx.post(guarded.url + COMPLETIONS, headers=AUTH, json={"prompt": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200


def test_client_gone_with_queued_prompts_stops_the_work(guarded):
    """16 prompts on 4 running slots: 12 wait. The client hangs up: every one of them is aborted at once."""
    max_tokens = 200
    body = json.dumps({"prompt": [f"Queued prompt {i}" for i in range(MAX_PROMPTS)], "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    before = guarded.metrics()["hybridserve:generation_tokens_total"]
    url = urlparse(guarded.url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    def queued() -> bool:
        m = guarded.metrics()
        return m["hybridserve:num_requests_running"] >= 1 and m["hybridserve:num_requests_waiting"] >= 1

    wait_for(queued, what="prompts running and waiting")
    sock.close()
    wait_for(lambda: idle(guarded), timeout=5.0, what="the gone client's prompts to be aborted")
    stopped = guarded.metrics()["hybridserve:generation_tokens_total"]
    time.sleep(0.5)
    assert guarded.metrics()["hybridserve:generation_tokens_total"] == stopped  # nothing generates for nobody
    assert stopped - before < MAX_PROMPTS * max_tokens


def test_streaming_client_gone_with_queued_prompts_stops_the_work(guarded):
    body = {"prompt": [f"Streamed prompt {i}" for i in range(MAX_PROMPTS)], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert guarded.metrics()["hybridserve:num_requests_waiting"] >= 1
    wait_for(lambda: idle(guarded), timeout=5.0, what="the gone client's prompts to be aborted")


# -------------------------------------------------------------------------------- responsiveness
async def _upload(client: httpx.AsyncClient, path: str, content: Any) -> httpx.Response:
    return await client.post(path, content=content, headers={"Content-Type": "application/json"})


def test_huge_bodies_do_not_stall_streams_or_health(guarded):
    """A 10 MiB prompt (declared, or chunked), a prompt too long to fit, 200k chat messages: each is
    refused quickly, while a running stream and /health stay responsive (a loose bound)."""
    ten_mib = json.dumps({"prompt": "Hello world " * (10 * 2 ** 20 // 12), "max_tokens": 4}).encode()
    too_long = {"prompt": "Hello world " * 40000, "max_tokens": 4}  # 480k characters, under the body limit
    huge_chat = json.dumps({"messages": [{"role": "user", "content": "x"}] * 200000}).encode()

    async def chunked():
        for i in range(0, len(ten_mib), 2 ** 16):
            yield ten_mib[i:i + 2 ** 16]

    health: list[float] = []

    async def bad(client: httpx.AsyncClient) -> list[httpx.Response]:
        done = asyncio.Event()

        async def probe():
            async with httpx.AsyncClient(base_url=guarded.url, timeout=30) as probe_client:
                while not done.is_set():
                    start = time.monotonic()
                    assert (await probe_client.get("/health")).status_code == 200
                    health.append(time.monotonic() - start)
                    await asyncio.sleep(0.02)

        task = asyncio.create_task(probe())
        try:
            return [await _upload(client, COMPLETIONS, ten_mib), await _upload(client, COMPLETIONS, chunked()),
                    await client.post(COMPLETIONS, json=too_long), await _upload(client, CHAT, huge_chat)]
        finally:
            done.set()
            await task

    responses, streams = asyncio.run(beside_good_streams(guarded, bad, max_tokens=200))
    declared, chunked_r, long_r, chat_r = responses
    for r in (declared, chunked_r, chat_r):
        error = error_of(r, 413)
        assert "--max-request-body-size" in error["message"] and f"{BODY_LIMIT:,}" in error["message"]
    error = error_of(long_r, 400)
    assert error["param"] == "prompt" and "max_model_len" in error["message"] and "characters" in error["message"]
    assert health and max(health) < RESPONSIVE_S, max(health)
    assert max(s.max_gap for s in streams) < RESPONSIVE_S, [s.max_gap for s in streams]
    assert_idle(guarded)


def test_chat_limits_and_length(guarded):
    bad = many(post(CHAT, {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}),
               post(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 100}]}),
               post(CHAT, chat_body("Hello world " * 40000)))
    count, parts, length = run_beside_good_streams(guarded, bad)
    for r in (count, parts):
        error = error_of(r, 400)
        assert error["param"] == "messages" and "--max-chat-messages" in error["message"]
    error = error_of(length, 400)
    assert error["param"] == "messages" and "max_model_len" in error["message"]


# ------------------------------------------------------------------------------ text and templates
SURROGATE = "\\ud800"


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, f'{{"prompt": "a{SURROGATE}b", "max_tokens": 2}}', "prompt"),
    (COMPLETIONS, f'{{"prompt": ["ok", "{SURROGATE}"], "max_tokens": 2}}', "prompt"),
    (COMPLETIONS, f'{{"prompt": "Hi", "stop": ["{SURROGATE}"]}}', "stop"),
    (COMPLETIONS, f'{{"prompt": "Hi", "model": "m{SURROGATE}"}}', "model"),
    (COMPLETIONS, '{"prompt": "Hi", "user": "\\udc00"}', "user"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages"),
    (CHAT, f'{{"messages": [{{"role": "{SURROGATE}", "content": "Hi"}}]}}', "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "Hi"}}], "model": "{SURROGATE}"}}', "model"),
])
def test_lone_surrogates_are_400(guarded, path, body, param):
    r = run_beside_good_streams(guarded, post(path, body.encode()), num_good=2)
    error = error_of(r, 400)
    assert error["param"] == param and "surrogate" in error["message"], error


def test_invalid_utf8_is_400_and_surrogate_pairs_are_fine(guarded):
    raw_surrogate = b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}'  # a surrogate encoded as UTF-8
    emoji = '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'.encode()  # a valid pair, escaped
    bad, good = run_beside_good_streams(guarded, many(post(COMPLETIONS, raw_surrogate), post(COMPLETIONS, emoji)),
                                        num_good=2, queues_nothing=False)
    assert "UTF-8" in error_of(bad, 400)["message"]
    assert good.status_code == 200, good.text


def test_chat_template_that_raises_is_400(guarded):
    bad = many(post(CHAT, chat_body("RAISE")),
               post(CHAT, {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "RAISE"}]}))
    for r in run_beside_good_streams(guarded, bad):
        error = error_of(r, 400)
        assert error["param"] == "messages" and "no: this template refuses RAISE" in error["message"]
    ok = httpx.post(guarded.url + CHAT, headers=AUTH, json=chat_body("Hello"))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


# --------------------------------------------------------------------------------- auth and hosts
def test_metrics_and_docs_need_the_key(guarded):
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        r = httpx.get(guarded.url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert httpx.get(guarded.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(guarded.url + path, headers=AUTH).status_code == 200, path
    assert "/v1/completions" in httpx.get(guarded.url + "/openapi.json", headers=AUTH).json()["paths"]
    assert httpx.get(guarded.url + "/health").status_code == 200  # probes need no key


@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1", True), ("localhost", True), ("localhost:1234", True), ("LOCALHOST.:80", True),
    ("[::1]:8000", True), ("[::1]", True), ("evil.example", False), ("localhost.evil.example", False),
    ("evil.example:80", False), ("127.0.0.1.nip.io", False), ("::1", False), ("[::1", False), ("", False),
])
def test_host_header_check(guarded, host, ok):
    r = httpx.get(guarded.url + "/health", headers={"Host": host})
    if ok:
        assert r.status_code == 200, r.text
    else:
        error = error_of(r, 400)
        assert "Host" in error["message"] and "--allowed-hosts" in error["message"]


def test_request_without_host_is_400(guarded):
    url = urlparse(guarded.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"Host" in answer


def test_served_name_is_the_directory_name(guarded):
    models = httpx.get(guarded.url + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(CKPT_NAME, CKPT_NAME)]
    text = httpx.get(guarded.url + "/metrics", headers=AUTH).text
    assert f'model_name="{CKPT_NAME}"' in text and os.sep + CKPT_NAME not in text
    r = httpx.post(guarded.url + COMPLETIONS, headers=AUTH, json={"model": CKPT_NAME, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == CKPT_NAME
