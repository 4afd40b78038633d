"""The OpenAI-compatible server, live on loopback, driven by the official ``openai`` client.

Two servers run for the whole module (started together): ``server``, a tiny Bamba with a chat
template and an API key; ``plain``, a tiny Bamba whose tokenizer has no chat template, with one
running sequence and a waiting queue of two (for the 503 path), and a 2 s shutdown grace period.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.server_utils import ServerProcess, idle, make_checkpoints, wait_for

API_KEY = "test-key"
MODEL = "tiny-bamba"
PLAIN = "tiny-plain"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    chat_ckpt, plain_ckpt = make_checkpoints(str(root))
    procs = {
        "server": ServerProcess(chat_ckpt, str(root / "server.log"), "--api-key", API_KEY,
                                "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
                                "--cache-memory", "32MiB", "--max-num-seqs", "64"),
        "plain": ServerProcess(plain_ckpt, str(root / "plain.log"), "--served-model-name", PLAIN,
                               "--max-model-len", str(MAX_MODEL_LEN), "--cache-memory", "16MiB",
                               "--max-num-seqs", "1", "--max-waiting-requests", "2", "--shutdown-timeout", "2"),
    }
    try:
        for proc in procs.values():
            proc.wait_healthy()
        procs["tokenizer"] = AutoTokenizer.from_pretrained(chat_ckpt)
        yield procs
    finally:
        for name in ("server", "plain"):
            procs[name].stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers["server"]


@pytest.fixture(scope="module")
def plain(servers) -> ServerProcess:
    return servers["plain"]


@pytest.fixture(scope="module")
def tokenizer(servers):
    return servers["tokenizer"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain_client(plain) -> openai.OpenAI:
    return openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# ---------------------------------------------------------------------------------------------- basics
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client, tokenizer):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    # token-id prompts and several prompts at once
    ids = tokenizer.encode(prompt)
    both = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [r.choices[0].text] * 2
    assert both.usage.completion_tokens == 24


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client, tokenizer):
    shared = tokenizer.encode("A shared system prompt: " + "be brief, " * 8)
    before = server.metrics()
    usage = []
    for tail in ("first question", "second question", "third question"):
        r = client.completions.create(model=MODEL, prompt=shared + tokenizer.encode(tail), max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
        usage.append(r.usage)
    assert usage[0].prompt_tokens_details.cached_tokens == 0
    assert usage[2].prompt_tokens_details.cached_tokens >= len(shared) - 1  # from the branch-point snapshot
    after = server.metrics()
    hits = after["hybridserve:prefix_cache_hits_total"] - before["hybridserve:prefix_cache_hits_total"]
    assert hits == sum(u.prompt_tokens_details.cached_tokens for u in usage)
    queries = after["hybridserve:prefix_cache_queries_total"] - before["hybridserve:prefix_cache_queries_total"]
    assert queries == sum(u.prompt_tokens for u in usage)
    assert after["hybridserve:prefix_cache_snapshots"] > 0 and after["hybridserve:prefix_cache_bytes"] > 0
    assert after["hybridserve:prefix_cache_kv_beyond_snapshot_total"] >= 1  # the second request's lookup


def test_chat(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens == 10
    completion = client.completions.create(model=MODEL, prompt=expected_prompt, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == completion.choices[0].text


def test_penalties_and_logit_bias_match_the_offline_engine(server, client, tokenizer):
    from hybridserve import LLM, SamplingParams

    prompt = tokenizer.encode("Hello world! Hello world! Hello")
    banned = tokenizer.encode(" world")[-1]
    options = dict(presence_penalty=0.7, frequency_penalty=0.4, logit_bias={banned: -100.0})
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  presence_penalty=0.7, frequency_penalty=0.4, logit_bias={str(banned): -100},
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    offline = LLM(server.model, max_model_len=MAX_MODEL_LEN, cache_memory="16MiB", enable_progress_bar=False)
    want = offline.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                                           **options))[0].outputs[0]
    assert r.choices[0].text == want.text and banned not in want.token_ids
    plain = offline.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert plain.token_ids != want.token_ids


# ------------------------------------------------------------------------------------------- streaming
def _stream_completion(client, **kw) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish, usage


@pytest.mark.parametrize("prompt", ["Hello world", "The quick brown fox"])
def test_stream_equals_non_stream(client, prompt):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    text, finish, usage = _stream_completion(client, **kw)
    assert text == full.choices[0].text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_with_stop_string_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**kw).choices[0].text
    candidates = [free[i:i + 3] for i in range(4, len(free) - 3) if "\ufffd" not in free[i:i + 3]]
    if not candidates:
        pytest.skip("the greedy text has no clean 3-character substring to stop at")
    stop = candidates[0]
    full = client.completions.create(stop=[stop], **kw)
    assert full.choices[0].text == free[:free.index(stop)]
    assert full.choices[0].finish_reason == "stop"
    text, finish, _ = _stream_completion(client, stop=[stop], **kw)
    assert (text, finish) == (full.choices[0].text, "stop")


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "How are you today?"}], max_tokens=20,
              temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw)
    text, roles, finish, tokens, usage = "", [], None, [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            tokens += [t.token for t in (c.logprobs.content if c.logprobs else None) or []]
    assert roles == ["assistant"]
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert tokens == [t.token for t in full.choices[0].logprobs.content]
    assert usage.completion_tokens == full.usage.completion_tokens


# -------------------------------------------------------------------------------------------- logprobs
def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0
        assert 1 <= len(top) <= 3
        assert token_lp >= max(top.values()) - 1e-5  # greedy: the chosen token is the most likely


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for t in content:
        assert len(t.top_logprobs) == 3
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6)
        assert t.bytes == list(t.token.encode("utf-8"))


# -------------------------------------------------------------------------------------------------- n
def test_n_greedy_equals_single(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    single = client.completions.create(**kw)
    many = client.completions.create(n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [single.choices[0].text] * 3
    assert many.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts (and runs) once
    assert many.usage.completion_tokens == 30


def test_n_sampled_differ_and_reproduce(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=16,
              temperature=1.5, seed=11, n=3, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) == 3
    streamed = [""] * 3
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts


# ----------------------------------------------------------------------------------------- auth, 4xx
def test_auth(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for headers in ({}, {"Authorization": API_KEY}, {"Authorization": "Basic " + API_KEY}):  # missing or malformed
        r = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for path in ("/health", "/metrics", "/docs", "/openapi.json"):  # open without --protect-metrics-and-docs
        assert httpx.get(server.url + path).status_code == 200, path


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(logprobs=50), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(extra_body={"n": "many"}), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0.0}), "repetition_penalty"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={str(10 ** 7): 1}), "logit_bias"),
    (dict(max_tokens=MAX_MODEL_LEN), "prompt"),
])
def test_bad_parameters_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**{"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw})
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_prompt_past_max_model_len_is_400(client):
    long_prompt = "Hello world! " * 200
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}])


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=4)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])


def test_chat_without_template_is_400(plain_client):
    with pytest.raises(openai.BadRequestError, match="chat template"):
        plain_client.chat.completions.create(model=PLAIN, messages=[{"role": "user", "content": "Hi"}])
    r = plain_client.completions.create(model=PLAIN, prompt="Hello", max_tokens=3)  # completions still work
    assert r.usage.completion_tokens >= 1


def test_queue_over_bound_is_503(plain, plain_client):
    """One sequence runs, two requests may wait; the next gets 503, nothing grows without bound."""
    kw = dict(model=PLAIN, prompt="Hello", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    running = plain_client.completions.create(**kw)
    next(iter(running))  # it produces tokens: it is running
    waiting = [plain_client.completions.create(**kw) for _ in range(2)]  # accepted (headers sent), queued
    try:
        wait_for(lambda: plain.metrics()["hybridserve:num_requests_waiting"] == 2, what="two waiting requests")
        with pytest.raises(openai.InternalServerError) as info:
            plain_client.completions.create(model=PLAIN, prompt="Hello", max_tokens=4)
        assert info.value.status_code == 503
        assert info.value.body["type"] == "service_unavailable_error"
    finally:
        running.close()
        for w in waiting:
            w.close()
    wait_for(lambda: idle(plain), what="the plain server to be idle")
    with pytest.raises(openai.BadRequestError, match="waiting bound"):  # more prompts than may ever wait
        plain_client.completions.create(model=PLAIN, prompt=["Hello"] * 3, max_tokens=4)


def test_waiting_bound_is_exact(plain):
    """Many concurrent requests, single and multi-prompt, on one running slot and a bound of two: the
    waiting gauge never passes 2, each request is served whole or refused whole (503), and none fails."""
    waves, per_wave = 3, 8

    async def one(client: httpx.AsyncClient, i: int) -> int:
        prompt = "Hello" if i % 3 else ["Hello", "world"]  # every third request has two prompts
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True})
        if r.status_code == 200:
            assert len(r.json()["choices"]) == (1 if i % 3 else 2)
        return r.status_code

    async def main() -> tuple[list[int], list[float]]:
        waiting: list[float] = []
        done = asyncio.Event()

        async def watch(client: httpx.AsyncClient) -> None:
            while not done.is_set():
                text = (await client.get("/metrics")).text
                line = next(x for x in text.splitlines() if x.startswith("hybridserve:num_requests_waiting"))
                waiting.append(float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.01)

        async with httpx.AsyncClient(base_url=plain.url, timeout=120) as client:
            watcher = asyncio.create_task(watch(client))
            tasks = []
            for wave in range(waves):
                tasks += [asyncio.create_task(one(client, wave * per_wave + i)) for i in range(per_wave)]
                await asyncio.sleep(0.1)
            statuses = await asyncio.gather(*tasks)
            done.set()
            await watcher
        return list(statuses), waiting

    statuses, waiting = asyncio.run(main())
    assert set(statuses) == {200, 503}, statuses
    assert waiting and max(waiting) <= 2, max(waiting)
    wait_for(lambda: idle(plain), what="the plain server to be idle")


# ------------------------------------------------------------------------------------ concurrency
def test_concurrent_streams_complete(server):
    num, max_tokens = 36, 24

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i}: once upon a time", max_tokens=max_tokens, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks, finish, tokens = 0, None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                chunks += 1
                finish = c.finish_reason or finish
        return chunks, finish, tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num)))

    before = server.metrics()["hybridserve:generation_tokens_total"]
    results = asyncio.run(main())
    assert all(finish == "length" and tokens == max_tokens and chunks >= 1
               for chunks, finish, tokens in results), results
    m = server.metrics()
    assert m["hybridserve:generation_tokens_total"] - before == num * max_tokens
    assert idle(server)


# ------------------------------------------------------------------------------------- disconnects
def test_streaming_disconnect_frees_cache(server, client):
    # The streams must still be generating when they are closed: on a loaded machine the server can finish
    # all 200 tokens before this client has read its first chunks, so an attempt that finds them done is
    # cleaned up and tried again (at most 3 attempts; then the test fails)
    for _ in range(3):
        before = server.metrics()["hybridserve:generation_tokens_total"]
        streams = [client.completions.create(model=MODEL, prompt=f"Story {i}", max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True}) for i in range(4)]
        for s in streams:
            it = iter(s)
            next(it), next(it)
        m = server.metrics()
        running = m["hybridserve:num_requests_running"] >= 1 and m["hybridserve:cache_usage_perc"] > 0
        for s in streams:
            s.close()
        wait_for(lambda: idle(server), timeout=5.0, what="running requests and cache usage to drop to 0")
        if running:
            break
    assert running, "every attempt's streams had finished before they were closed"
    assert server.metrics()["hybridserve:generation_tokens_total"] - before < 4 * 200  # aborted, not finished


def test_non_streaming_disconnect_frees_cache(plain):
    """A non-streaming client that hangs up mid-generation has its request aborted at once.

    On the server that runs one sequence at a time, so the n completions take n times as long as one:
    long enough to be cut short on a fast machine too."""
    import json as _json
    import socket
    from urllib.parse import urlparse

    before = plain.metrics()["hybridserve:generation_tokens_total"]
    max_tokens, n = MAX_MODEL_LEN - 16, 16
    body = _json.dumps({"model": PLAIN, "prompt": [5, 6, 7], "max_tokens": max_tokens, "n": n,
                        "ignore_eos": True}).encode()
    url = urlparse(plain.url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: plain.metrics()["hybridserve:num_requests_running"] == 1, what="the request to run")
    sock.close()  # the client gives up while its request is generating
    wait_for(lambda: idle(plain), timeout=5.0, what="running requests and cache usage to drop to 0")
    assert plain.metrics()["hybridserve:generation_tokens_total"] - before < n * max_tokens


# ------------------------------------------------------------------------------------------ metrics
def test_metrics(server):
    text = httpx.get(server.url + "/metrics").text
    for name, kind in [("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                       ("cache_usage_perc", "gauge"), ("prompt_tokens_total", "counter"),
                       ("generation_tokens_total", "counter"), ("num_preemptions_total", "counter"),
                       ("time_to_first_token_seconds", "histogram"), ("inter_token_latency_seconds", "histogram"),
                       ("kernel_fallbacks_total", "counter")]:
        assert f"# TYPE hybridserve:{name} {kind}" in text
    m = server.metrics()
    assert m["hybridserve:prompt_tokens_total"] > 0 and m["hybridserve:generation_tokens_total"] > 0
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        count = m[f"hybridserve:{hist}_count"]
        assert count > 0 and m[f"hybridserve:{hist}_bucket|+Inf"] == count and m[f"hybridserve:{hist}_sum"] > 0
        buckets = [v for k, v in m.items() if k.startswith(f"hybridserve:{hist}_bucket|")]
        assert buckets == sorted(buckets)


# ------------------------------------------------------------------------------------------ shutdown
def test_sigterm_drains_and_exits_zero(plain, plain_client):
    """Last test of the plain server: SIGTERM stops accepting, ends the stream in flight, exits 0."""
    stream = plain_client.completions.create(model=PLAIN, prompt="Hello", max_tokens=250, stream=True,
                                             extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    plain.proc.terminate()
    finish = None
    for chunk in it:  # the stream ends cleanly: finished, or aborted after the 2 s grace period
        for c in chunk.choices:
            finish = c.finish_reason or finish
    assert finish in ("length", "abort")

    def refused() -> bool:
        try:
            httpx.get(plain.url + "/health", timeout=1.0)
        except httpx.TransportError:
            return True
        return False

    wait_for(refused, what="the server to stop accepting")
    assert plain.proc.wait(timeout=30) == 0, plain.log()
