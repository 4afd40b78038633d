"""Helpers of the server tests: tiny checkpoints with a tokenizer, and a live server on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.checkpoints import bamba_config, build

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
#: CHAT_TEMPLATE, but it raises (a jinja2 TemplateError) on a message whose content is "RAISE"
RAISING_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'RAISE' %}"
                         "{{ raise_exception('no: this template refuses RAISE') }}{% endif %}"
                         "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?",
          "Once upon a time there was a small model that served many requests at once.",
          "user: what is the capital of France? assistant: Paris is the capital of France."]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_tokenizer(chat_template: bool | str):
    """A small byte-level BPE tokenizer (a transformers fast tokenizer), with a chat template (CHAT_TEMPLATE,
    or the one given) or none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)
    if chat_template:
        fast.chat_template = chat_template if isinstance(chat_template, str) else CHAT_TEMPLATE
    return fast


def make_checkpoints(root: str) -> tuple[str, str]:
    """Two tiny Bamba (Mamba2 + attention) checkpoints with the same weights and tokenizer: the first
    with a chat template, the second without one."""
    chat, plain = os.path.join(root, "bamba-chat"), os.path.join(root, "bamba-plain")
    tokenizer = train_tokenizer(chat_template=True)
    build(bamba_config(vocab_size=len(tokenizer)), chat)
    shutil.copytree(chat, plain)
    tokenizer.save_pretrained(chat)
    train_tokenizer(chat_template=False).save_pretrained(plain)
    return chat, plain


def make_checkpoint(path: str, chat_template: bool | str = True) -> str:
    """One tiny Bamba checkpoint with a tokenizer (and the chat template given, see train_tokenizer)."""
    tokenizer = train_tokenizer(chat_template)
    build(bamba_config(vocab_size=len(tokenizer)), path)
    tokenizer.save_pretrained(path)
    return path


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: the OS may offer one again before it is bound


def free_port() -> int:
    """A loopback port nothing listens on, never one this process was given before (a test that starts
    several servers asks for all their ports before any of them binds)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_until_answers(proc: subprocess.Popen, url: str, what: str, log, timeout: float, interval: float) -> None:
    """Poll ``url`` until it answers 200; RuntimeError with ``log()`` if ``proc`` exits first or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{what} not ready after {timeout} s:\n{log()}")


def log_tail(handle, path: str) -> str:
    """The last 5,000 characters a subprocess wrote to ``path`` (``handle``: the file it writes, flushed first)."""
    handle.flush()
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")[-5000:]


def _limit_open_files(count: int) -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


class ServerProcess:
    """``hybridserve serve`` in a subprocess on a free loopback port."""

    def __init__(self, model: str, log_path: str, *args: str, api_key: str | None = None,
                 open_files: int | None = None) -> None:
        """``api_key``: passed as --api-key, and sent to /metrics (for a server that protects it);
        ``open_files``: the server's file descriptor limit (``ulimit -n``), if given."""
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        args = (*args, "--api-key", api_key) if api_key else args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", "--device", "cpu", *args]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                     preexec_fn=None if open_files is None else lambda: _limit_open_files(open_files))

    def wait_healthy(self, timeout: float = 120.0) -> None:
        wait_until_answers(self.proc, self.url + "/health", "server", self.log, timeout, 0.2)

    def log(self) -> str:
        return log_tail(self._log, self.log_path)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {name (labels dropped, but le kept for buckets): value, summed over the series a name
        has (a counter by reason, say)}."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=5.0).text
        values = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, value = line.rsplit(" ", 1)
            base = name.split("{", 1)[0]
            if 'le="' in name:
                base += "|" + name.split('le="', 1)[1].split('"', 1)[0]
            values[base] = values.get(base, 0.0) + float(value)
        return values

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it lingers; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    """``predicate()``'s first truthy value, polled every 50 ms; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def idle(server: ServerProcess) -> bool:
    """Whether ``/metrics`` shows 0 running, 0 waiting and cache usage 0."""
    m = server.metrics()
    return (m["hybridserve:num_requests_running"] == 0 and m["hybridserve:num_requests_waiting"] == 0
            and m["hybridserve:cache_usage_perc"] == 0)
