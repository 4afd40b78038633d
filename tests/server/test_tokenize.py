"""``POST /tokenize`` and ``POST /detokenize``, and the served model names, on the real app (in process) over a
tiny Bamba checkpoint with a trained tokenizer: results against the tokenizer itself, bad input as 400s."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import make_checkpoints

KEY = "tok-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("tiny", "tiny-alias")
MAX_MODEL_LEN = 128
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def _client(path: str, names: tuple[str, ...]) -> TestClient:
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_memory="8MiB", max_model_len=MAX_MODEL_LEN,
                                    max_num_seqs=2, enable_progress_bar=False))
    state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                        model_name=names[0], extra_model_names=names[1:], max_model_len=engine.max_model_len,
                        api_key=KEY)
    return TestClient(build_app(state), base_url="http://localhost")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return make_checkpoints(str(tmp_path_factory.mktemp("tokenize")))


@pytest.fixture(scope="module")
def client(checkpoints):
    with _client(checkpoints[0], NAMES) as c:
        yield c


@pytest.fixture(scope="module")
def plain(checkpoints):
    """The same model whose tokenizer has no chat template."""
    with _client(checkpoints[1], ("plain",)) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return AutoTokenizer.from_pretrained(checkpoints[0])


def _post(client: TestClient, route: str, body: dict, status: int = 200) -> dict:
    r = client.post(route, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    return r.json()


def _error(client: TestClient, route: str, body: dict, status: int = 400) -> dict:
    error = _post(client, route, body, status)["error"]
    assert "Traceback" not in error["message"]
    return error


def test_tokenize_prompt(client, tokenizer):
    text = "Once upon a time there was a fox."
    out = _post(client, "/tokenize", {"model": "tiny", "prompt": text})
    ids = tokenizer.encode(text)
    assert out == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    out = _post(client, "/tokenize", {"prompt": text, "return_token_strs": True, "add_special_tokens": False})
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert out["tokens"] == ids and out["token_strs"] == tokenizer.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_chat(client, tokenizer, add_generation_prompt):
    out = _post(client, "/tokenize", {"model": "tiny-alias", "messages": MESSAGES,
                                      "add_generation_prompt": add_generation_prompt})
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert out["tokens"] == ids and out["count"] == len(ids)
    assert rendered.endswith("<|assistant|>") == add_generation_prompt


def test_detokenize_round_trip(client, tokenizer):
    text = "Hello world! How are you today?"
    ids = _post(client, "/tokenize", {"prompt": text})["tokens"]
    assert _post(client, "/detokenize", {"model": "tiny", "tokens": ids}) == {
        "prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert _post(client, "/detokenize", {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("tokens, where", [([5, 100000], "tokens[1]"), ([-1], "tokens[0]")])
def test_detokenize_out_of_vocabulary_is_400(client, tokenizer, tokens, where):
    error = _error(client, "/detokenize", {"tokens": tokens})
    assert error["param"] == "tokens" and where in error["message"] and str(tokens[-1]) in error["message"]
    assert str(len(tokenizer) - 1) in error["message"]  # names the valid range


@pytest.mark.parametrize("body, param", [
    ({"tokens": "12"}, "tokens"), ({"tokens": [1, True]}, "tokens"), ({"tokens": [1.5]}, "tokens"), ({}, "tokens"),
])
def test_detokenize_wrong_types_are_400(client, body, param):
    assert _error(client, "/detokenize", body)["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"prompt": 12}, "prompt"), ({"messages": "hi"}, "messages"), ({}, "messages"),
    ({"prompt": "a", "messages": MESSAGES}, "prompt"), ({"messages": []}, "messages"),
    ({"prompt": "a", "return_token_strs": "maybe"}, "return_token_strs"),
])
def test_tokenize_bad_input_is_400(client, body, param):
    assert _error(client, "/tokenize", body)["param"] == param


def test_tokenize_chat_without_template_is_400(plain):
    error = _error(plain, "/tokenize", {"messages": MESSAGES})
    assert error["param"] == "messages" and "chat template" in error["message"]
    assert _post(plain, "/tokenize", {"prompt": "Hello"})["count"] > 0


@pytest.mark.parametrize("route, body", [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})])
def test_unknown_model_is_404_naming_the_served_ones(client, route, body):
    error = _error(client, route, {**body, "model": "gpt-4"}, 404)
    assert error["param"] == "model" and "gpt-4" in error["message"]
    assert all(f"`{name}`" in error["message"] for name in NAMES)


def test_the_key_is_needed(client):
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 401
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401


def test_models_lists_every_served_name_and_each_is_accepted(client):
    r = client.get("/v1/models", headers=AUTH)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == list(NAMES)
    for name in NAMES:
        out = _post(client, "/v1/completions", {"model": name, "prompt": "Hello", "max_tokens": 2})
        assert out["model"] == NAMES[0]  # responses carry the first name
    error = _error(client, "/v1/completions", {"model": "other", "prompt": "Hello", "max_tokens": 2}, 404)
    assert error["code"] == "model_not_found"
