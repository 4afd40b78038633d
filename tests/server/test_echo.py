"""Completions' ``echo`` and prompt logprobs, and ``max_tokens=0`` (prefill only), offline and served.

The served prompt logprobs are checked against the offline engine's ``prompt_logprobs`` (same engine:
equal to float32 rounding) and against HF transformers' float32 ``log_softmax`` of the same checkpoint
(other kernels: a few 1e-6 apart here; 1e-4 still catches any wrong position or token).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from hybridserve import LLM, SamplingParams
from tests.hf_reference import hf_model
from tests.prefix_utils import released_everything
from tests.server.server_utils import ServerProcess, idle, make_checkpoint, wait_for

MODEL = "tiny-echo"
HF_TOL = 1e-4  # our kernels vs HF's, both float32 (see the module docstring)
SAME_ENGINE_TOL = 1e-5  # the server vs the offline engine: the same computation, batched differently
PROMPTS = ["The quick brown fox jumps", "Hello world! How are you today?"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("echo") / "ckpt"))


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    proc = ServerProcess(ckpt, str(tmp_path_factory.mktemp("echo-log") / "server.log"), "--served-model-name", MODEL,
                         "--max-model-len", "256", "--cache-memory", "32MiB", "--max-num-batched-tokens", "16")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return AutoTokenizer.from_pretrained(ckpt)


def _post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def _hf_logprobs(ckpt: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(ckpt)(torch.tensor([ids])).logits[0].float(), -1)  # (L, V)


def _check_offsets(text: str, lp: dict) -> None:
    """Each token starts where the ones before it end (these prompts are ASCII: a token's string is its text)."""
    assert lp["text_offset"][0] == 0
    for i, (token, start) in enumerate(zip(lp["tokens"], lp["text_offset"])):
        end = lp["text_offset"][i + 1] if i + 1 < len(lp["tokens"]) else len(text)
        assert text[start:end] == token, (i, token, start)


# ------------------------------------------------------------------------------------------- engine
def test_sampling_params_max_tokens_zero():
    assert SamplingParams(max_tokens=0).max_tokens == 0
    with pytest.raises(ValueError, match="min_tokens=1 .*at most max_tokens=0"):
        SamplingParams(max_tokens=0, min_tokens=1)
    with pytest.raises(ValueError, match=r"max_tokens=-1 .*>= 0"):
        SamplingParams(max_tokens=-1)


@pytest.mark.parametrize("options", [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 8}],
                         ids=["prefix-caching", "no-prefix-caching", "chunked-prefill"])
def test_engine_max_tokens_zero(ckpt, options):
    """Prefill only: no token, finish reason "length", the same prompt logprobs as a generating request, n
    identical empty completions for n > 1, and every cache block released."""
    llm = LLM(ckpt, cache_memory="16MiB", **options)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    for n in (1, 3):
        out = llm.generate([prompt] * 2, SamplingParams(max_tokens=0, n=n, prompt_logprobs=2))
        for o in out:
            assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in o.outputs] == [
                (i, "", [], "length") for i in range(n)]
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt["prompt_token_ids"])
            for got, want in zip(o.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                assert got.keys() == want.keys()
                assert all(abs(got[t].logprob - want[t].logprob) < SAME_ENGINE_TOL for t in want)
        assert released_everything(llm.engine)


def test_engine_max_tokens_zero_abort(ckpt):
    """A prefill-only request aborted while its prompt is still being computed frees everything."""
    llm = LLM(ckpt, cache_memory="16MiB", max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("a", list(range(3, 60)), SamplingParams(max_tokens=0, prompt_logprobs=1))
    engine.add_request("b", list(range(3, 30)), SamplingParams(max_tokens=0))
    engine.step()
    assert engine.cache.held_bytes() > 0
    engine.abort_request("a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs if o.finished] == [("b", "length")]
    assert released_everything(engine)


def test_engine_max_tokens_zero_rules(ckpt):
    llm = LLM(ckpt, cache_memory="16MiB", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):  # the prompt itself must still fit
        llm.engine.add_request("x", list(range(3, 70)), SamplingParams(max_tokens=0))
    out = llm.generate([{"prompt_token_ids": list(range(3, 67))}], SamplingParams(max_tokens=0))[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == []


# ------------------------------------------------------------------------------------------- server
def test_echo_prompt_logprobs_match_offline_and_hf(server, ckpt, tokenizer):
    r = _post(server, prompt=PROMPTS, echo=True, logprobs=2, max_tokens=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 0
    llm = LLM(ckpt, cache_memory="16MiB")
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=2))
    for choice, prompt, off in zip(body["choices"], PROMPTS, offline):
        ids = tokenizer.encode(prompt)
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        _check_offsets(prompt, lp)
        ref = _hf_logprobs(ckpt, ids)
        for pos in range(1, len(ids)):
            got = lp["token_logprobs"][pos]
            assert abs(got - off.prompt_logprobs[pos][ids[pos]].logprob) < SAME_ENGINE_TOL
            assert abs(got - float(ref[pos - 1, ids[pos]])) < HF_TOL, pos
            top = ref[pos - 1].topk(2)
            want_top = {tokenizer.decode([t]): float(v) for v, t in zip(top.values, top.indices.tolist())}
            assert lp["top_logprobs"][pos].keys() == want_top.keys()
            assert all(abs(lp["top_logprobs"][pos][k] - v) < HF_TOL for k, v in want_top.items())
    wait_for(lambda: idle(server), what="the server to release every request")


def test_echo_token_ids_then_generated(server, ckpt, tokenizer):
    """Token-id prompts: the decoded prompt, then the generated tokens (as a request without echo makes them),
    whose offsets continue after the prompt's text: each is the length of the complete text before it."""
    ids = [tokenizer.encode(p) for p in PROMPTS]
    body = dict(prompt=ids, max_tokens=6, logprobs=1, temperature=0, ignore_eos=True)
    plain, echoed = _post(server, **body).json(), _post(server, echo=True, **body).json()
    offline = LLM(ckpt, cache_memory="16MiB").generate(
        [{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for p, c, e, off in zip(ids, plain["choices"], echoed["choices"], offline):
        out = off.outputs[0].token_ids
        assert c["text"] == off.outputs[0].text
        assert c["logprobs"]["text_offset"] == [len(tokenizer.decode(out[:j]).rstrip("\ufffd")) for j in range(6)]
        prompt_text = tokenizer.decode(p)
        assert e["text"] == prompt_text + c["text"]
        lp, gen = e["logprobs"], c["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in p] + gen["tokens"]
        assert len(lp["token_logprobs"]) == len(p) + 6 and lp["token_logprobs"][0] is None
        assert all(abs(a - b) < SAME_ENGINE_TOL for a, b in zip(lp["token_logprobs"][len(p):], gen["token_logprobs"]))
        assert lp["text_offset"][len(p):] == [len(prompt_text) + o for o in gen["text_offset"]]
        _check_offsets(prompt_text, {k: v[:len(p)] for k, v in lp.items()})


def test_echo_without_logprobs_and_single_prompt(server):
    r = _post(server, prompt=PROMPTS[0], echo=True, max_tokens=2, temperature=0).json()
    (choice,) = r["choices"]
    assert choice["text"].startswith(PROMPTS[0]) and len(choice["text"]) > len(PROMPTS[0])
    assert choice["logprobs"] is None


def test_echo_n_greater_than_one(server):
    """n > 1 with max_tokens=0: n identical echoes (as vLLM answers)."""
    r = _post(server, prompt=PROMPTS, echo=True, logprobs=1, max_tokens=0, n=2).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(PROMPTS):
        a, b = r["choices"][2 * p: 2 * p + 2]
        assert a["text"] == b["text"] == prompt and a["logprobs"] == b["logprobs"]


def _stream(server, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_echo_stream(server):
    """The first chunk carries the prompt (and its logprobs); all chunks join into the non-streamed answer."""
    body = dict(prompt=PROMPTS[1], echo=True, logprobs=1, max_tokens=4, temperature=0, ignore_eos=True)
    whole = _post(server, **body).json()["choices"][0]
    chunks = [c["choices"][0] for c in _stream(server, **body)]
    assert chunks[0]["text"].startswith(PROMPTS[1])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key], key
    streamed = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and whole["logprobs"]["token_logprobs"][0] is None
    assert len(streamed) == len(whole["logprobs"]["token_logprobs"])
    assert all(abs(a - b) < SAME_ENGINE_TOL for a, b in zip(streamed[1:], whole["logprobs"]["token_logprobs"][1:]))
    assert chunks[-1]["finish_reason"] == "length"
    only = _stream(server, prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0)
    assert len(only) == 1 and only[0]["choices"][0]["text"] == PROMPTS[0]
    assert only[0]["choices"][0]["finish_reason"] == "length"
    texts: dict[int, str] = {}  # two prompts, n=2, no logprobs: every choice's stream starts with its prompt
    for chunk in _stream(server, prompt=PROMPTS, echo=True, max_tokens=3, n=2, temperature=0, ignore_eos=True):
        for c in chunk["choices"]:
            assert c["logprobs"] is None
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    assert all(texts[i].startswith(PROMPTS[i // 2]) and len(texts[i]) > len(PROMPTS[i // 2]) for i in texts)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", dict(prompt="Hi", max_tokens=0), "max_tokens"),  # prefill only needs echo
    ("/v1/completions", dict(prompt="Hi", max_tokens=0, echo=True, min_tokens=1), "min_tokens"),
    ("/v1/completions", dict(prompt="Hi", max_tokens=-1, echo=True), "max_tokens"),
    ("/v1/completions", dict(prompt="Hi", max_tokens=0, echo=True, logprobs=21), "logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=0), "max_tokens"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=0),
     "max_completion_tokens"),
])
def test_bad_combinations_are_400(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


def test_echo_offsets_of_multibyte_text(server, tokenizer):
    """Byte-level tokens that split a character: each token's offset is the length of the complete text
    before it, so the tokens of one character share the offset where it starts."""
    prompt = "Café naïve 😀 ok"
    ids = tokenizer.encode(prompt)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some token does split a character
    lp = _post(server, prompt=prompt, echo=True, logprobs=0, max_tokens=0).json()["choices"][0]["logprobs"]
    assert lp["text_offset"] == [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(prompt)
    assert lp["top_logprobs"][1:] == [{}] * (len(ids) - 1)  # logprobs=0: the prompt token's own logprob only
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
