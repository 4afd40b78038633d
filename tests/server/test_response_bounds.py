"""Hostile-client probes (issue 33) against a live server on loopback: the response a request may buy is bounded
(``--max-response-entries``) before any work, a large allowed response is built without stalling ``/health``,
and sampling values at the edges of their ranges are 400s naming the range, never 500s."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from hybridserve.entrypoints.openai.limit_checks import response_entries
from tests.server.server_utils import ServerProcess, idle, make_checkpoint, wait_for

MODEL = "tiny-bounds"
MAX_MODEL_LEN = 1024
MAX_ENTRIES = 1_000_000  # the default of --max-response-entries
#: /health must answer within this while a large allowed response is built (it stalled for seconds before)
HEALTH_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    ckpt = make_checkpoint(str(root / "ckpt"))
    proc = ServerProcess(ckpt, str(root / "server.log"), "--served-model-name", MODEL,
                         "--max-model-len", str(MAX_MODEL_LEN), "--cache-memory", "64MiB",
                         "--max-num-batched-tokens", "1024")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def vocab_size(server) -> int:
    """The model's vocabulary size (its tokenizer's here), as /detokenize's 400 for an id outside it names it."""
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": [10 ** 6]})
    return int(r.json()["error"]["message"].rsplit("ids 0 to ", 1)[1].split(")")[0]) + 1


def _post(server: ServerProcess, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=timeout)


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "internal error" not in error["message"]
    return error


def _prompt_tokens(server: ServerProcess) -> float:
    return server.metrics()["hybridserve:prompt_tokens_total"]


# ------------------------------------------------------------------------------------ the bound
def test_response_entries_count_what_is_serialized():
    # n x (echoed prompt tokens + generated) x (1 + top logprobs): 2 x (30 + 2 x 5) x 4
    assert response_entries(2, [10, 20], True, 5, 100, 3) == (320, 30, 10)
    # max_tokens unset counts up to max_model_len; a max_tokens past what fits counts what fits
    assert response_entries(3, [90], False, None, 100, None) == (30, 0, 10)
    assert response_entries(1, [90], False, 10 ** 9, 100, 0) == (10, 0, 10)


def test_a_response_past_the_bound_is_refused_before_any_work(server):
    before = _prompt_tokens(server)
    prompt = [(7 * i) % 250 + 3 for i in range(900)]
    r = _post(server, "/v1/completions", {"prompt": prompt, "n": 128, "max_tokens": 0, "echo": True, "logprobs": 20})
    message = _error(r)["message"]
    entries = 128 * 900 * 21
    assert f"{entries:,} entries" in message and f"{MAX_ENTRIES:,}" in message, message
    assert "--max-response-entries" in message and "logprobs=20" in message, message
    # chat: n completions of up to max_model_len - prompt tokens each, with top_logprobs
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 64,
                                               "logprobs": True, "top_logprobs": 20})
    message = _error(r)["message"]
    assert "top_logprobs=20" in message and "--max-response-entries" in message, message
    # several prompts count together
    r = _post(server, "/v1/completions", {"prompt": [prompt[:500]] * 8, "n": 32, "max_tokens": 500, "echo": True,
                                          "logprobs": 5})
    message = _error(r)["message"]
    assert f"{32 * 8 * (500 + 500) * 6:,} entries" in message and "over 8 prompts" in message, message
    assert _prompt_tokens(server) == before  # nothing was queued
    # what lm-eval sends (echo, logprobs, a long prompt, n=1) is far inside the bound
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 5})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 901


class HealthPoller:
    """Polls ``/health`` every 20 ms in a thread (at most ``limit_s`` seconds) and records the slowest answer."""

    def __init__(self, url: str, limit_s: float = 60.0) -> None:
        self.url = url
        self.limit_s = limit_s
        self.slowest = 0.0
        self.answers = 0  # 200s
        self.failures = 0  # anything else
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        end = time.monotonic() + self.limit_s
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set() and time.monotonic() < end:
                start = time.monotonic()
                status = client.get(self.url + "/health").status_code
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.answers += status == 200
                self.failures += status != 200
                self._stop.wait(0.02)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=35)


@pytest.mark.parametrize("stream", [False, True])
def test_health_answers_while_a_large_allowed_response_is_built(server, stream):
    """48 echoes of a 990-token prompt with 20 top logprobs each: 998,000 entries (over 10 MB of JSON), just inside
    the bound. It used to be built on the event loop, which then answered nothing else for seconds."""
    prompt = [(11 * i) % 250 + 3 for i in range(990)]
    body = {"prompt": prompt, "n": 48, "max_tokens": 0, "echo": True, "logprobs": 20, "stream": stream}
    with HealthPoller(server.url) as health:
        r = _post(server, "/v1/completions", body, timeout=120)
    assert r.status_code == 200, r.text[:500]
    if stream:
        chunks = [line for line in r.text.splitlines() if line.startswith("data: {")]
        assert len(chunks) == 48 and r.text.rstrip().endswith("data: [DONE]")
        assert all('"top_logprobs":[null,{' in chunk for chunk in chunks)
    else:
        choices = r.json()["choices"]
        assert len(choices) == 48 and all(len(c["logprobs"]["top_logprobs"]) == 990 for c in choices)
        tops = choices[0]["logprobs"]["top_logprobs"]  # {token string: logprob}: tokens that decode alike merge
        assert tops[0] is None and all(1 <= len(top) <= 20 for top in tops[1:])
    assert len(r.content) > 10_000_000  # a large response indeed
    assert health.answers >= 3 and not health.failures and health.slowest < HEALTH_S, vars(health)
    wait_for(lambda: idle(server), timeout=10.0, what="an idle server")


# ------------------------------------------------------------------------- 400, never 500
def test_logit_bias_keys_outside_the_vocabulary_are_400(server, vocab_size):
    for key in ("9" * 5000, "1" + "0" * 30, str(vocab_size)):
        for path, extra in (("/v1/completions", {"prompt": "Hello"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            error = _error(_post(server, path, {**extra, "max_tokens": 2, "logit_bias": {key: 1}}))
            assert error["param"] == "logit_bias" and f"{vocab_size:,} tokens" in error["message"], error
            assert len(error["message"]) < 300, error["message"]  # the key is shown cut short
    # leading zeros are still the token id they spell
    r = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0,
                                          "logit_bias": {"0" * 5000 + "5": 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


@pytest.mark.parametrize("field, value, allowed", [
    ("repetition_penalty", 1e-300, "[0.01, 100]"),
    ("repetition_penalty", 0.0, "[0.01, 100]"),
    ("repetition_penalty", -1.0, "[0.01, 100]"),
    ("repetition_penalty", 1e300, "[0.01, 100]"),
    ("temperature", 1e300, "[0, 100]"),
    ("temperature", 1e30, "[0, 100]"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -1e300, "[-2, 2]"),
    ("top_p", 1e-300, None),  # allowed: keeps the most likely token
    ("top_p", 1.5, "(0, 1]"),
    ("min_p", 1e-300, None),
    ("min_p", 2.0, "[0, 1]"),
    ("top_k", 10 ** 30, None),  # larger than the vocabulary: all of it
    ("top_k", -2, "0 or -1 disables it"),
])
def test_sampling_values_at_their_edges_are_400_naming_the_range(server, field, value, allowed):
    body = {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 3, "min_tokens": 2, "seed": 1, field: value}
    r = _post(server, "/v1/completions", body)
    if allowed is None:
        assert r.status_code == 200, r.text[:500]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        return
    error = _error(r)
    assert error["param"] == field and allowed in error["message"], error


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
def test_infinite_and_nan_sampling_values_are_400(server, field):
    for raw in ("1e400", "-1e400", "NaN"):
        body = f'{{"model": "{MODEL}", "prompt": "Hello", "max_tokens": 2, "{field}": {raw}}}'
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        error = _error(r)
        assert field in (error["param"] or "") + error["message"] or raw == "NaN", (raw, error)


@pytest.mark.parametrize("token", [10 ** 30, -5, 2 ** 32])
def test_echo_of_token_ids_outside_the_vocabulary_is_400(server, vocab_size, token):
    """echo decodes the prompt before the engine sees it: an id the tokenizer cannot take was a 500."""
    for prompt in ([5, token], [[5, 6], [7, token]]):
        error = _error(_post(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 1}))
        assert error["param"] == "prompt" and f"[0, {vocab_size})" in error["message"], error
        assert str(token)[:20] in error["message"], error


def test_chat_top_logprobs_out_of_range_names_top_logprobs(server):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                               "logprobs": True, "top_logprobs": 10 ** 30})
    error = _error(r)
    assert error["param"] == "top_logprobs" and "between 0 and 20" in error["message"], error
