"""A vision-language checkpoint (``Qwen3_5ForConditionalGeneration``) served as text: text chat works, and a
message with an image part is refused with HTTP 400 naming ``messages`` and the part's type."""

from __future__ import annotations

import httpx

from tests.checkpoints import build, qwen3_5_vl_config
from tests.server.server_utils import ServerProcess, train_tokenizer

MODEL = "tiny-qwen3.5-vl"


def test_text_served_and_image_part_refused(tmp_path):
    tokenizer = train_tokenizer(chat_template=True)
    path = str(tmp_path / "qwen3_5_vl")
    build(qwen3_5_vl_config(vocab_size=len(tokenizer)), path)
    tokenizer.save_pretrained(path)
    server = ServerProcess(path, str(tmp_path / "server.log"), "--served-model-name", MODEL, "--cache-memory", "16MiB")
    try:
        server.wait_healthy()
        url = server.url + "/v1/chat/completions"
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        refused = httpx.post(url, timeout=30, json={"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]}]})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "messages" and "'image_url'" in error["message"] and "text" in error["message"]
        served = httpx.post(url, timeout=30, json={"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]})
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
