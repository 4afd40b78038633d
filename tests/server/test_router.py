"""Data parallel: two ``hybridserve serve`` replicas of the shipped model behind vllm-router (docs/data_parallel.md).

* ``cache_aware`` (the router's default): every request through the router is answered with the greedy text
  of a direct call to one replica, and both replicas take work (their ``request_success_total``).
* ``kv_aware``: the router subscribes to both replicas' KV cache events (``--kv-events-config``) and sends a
  request (a completion or a chat) to the replica that holds its prefix, which then resumes from its prefix cache.

Skipped when ``vllm-router`` (PyPI, in the test extras) or ``pyzmq``/``msgpack`` are not installed.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from hybridserve.default_model import default_model_path
from tests.server.server_utils import ServerProcess, free_port, log_tail, wait_until_answers

ROUTER = shutil.which("vllm-router")
pytestmark = [
    pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router==0.1.17)"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("zmq", "msgpack")),
                       reason="the KV event publisher needs pyzmq and msgpack (pip install 'hybridserve[kv-events]')"),
]

MODEL = "hybridserve-default"
#: a long shared opening (several 16-token blocks), and the openings that follow it
OPENING = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
           "must be in want of a wife. ")
TOPICS = ["Mr. Darcy", "Elizabeth", "Jane", "Mrs. Bennet", "Mr. Collins", "Lydia", "Bingley", "Charlotte"]


class RouterProcess:
    """``vllm-router`` in a subprocess on free loopback ports (it listens once a worker is healthy)."""

    def __init__(self, log_path: str, workers: list[ServerProcess], *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port()),
               "--worker-urls", *[w.url for w in workers], "--log-level", "info", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **(env or {})), start_new_session=True)

    def wait_ready(self, timeout: float = 30.0) -> None:
        wait_until_answers(self.proc, self.url + "/readiness", "vllm-router", self.log, timeout, 0.1)

    def log(self) -> str:
        return log_tail(self._log, self.log_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas of the shipped model, each publishing its KV cache events on a port of its own."""
    logs = tmp_path_factory.mktemp("replicas")
    servers = []
    try:
        for i in range(2):
            config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"}
            server = ServerProcess(default_model_path(), str(logs / f"replica{i}.log"), "--served-model-name", MODEL,
                                   "--max-num-seqs", "8", "--kv-events-config", json.dumps(config))
            server.kv_endpoint = config["endpoint"]
            servers.append(server)
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def start_router(tmp_path, replicas):
    routers = []

    def start(*args: str, env: dict | None = None) -> RouterProcess:
        router = RouterProcess(str(tmp_path / f"router{len(routers)}.log"), replicas, *args, env=env)
        routers.append(router)
        router.wait_ready()
        return router

    yield start
    for router in routers:
        router.stop()


def completed(server: ServerProcess) -> float:
    return server.metrics()["hybridserve:request_success_total"]


def complete(base_url: str, prompt: str, chat: bool) -> str:
    """The greedy text of one request, through the ``openai`` client."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    if chat:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=12, temperature=0)
        return r.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    return r.choices[0].text


def test_cache_aware_router_answers_every_request_and_uses_both_replicas(replicas, start_router):
    router = start_router("--policy", "cache_aware")
    requests = [(f"{topic} said: " + OPENING * (i % 2), i % 3 == 0) for i, topic in enumerate(TOPICS * 2)]
    expected = [complete(replicas[0].url, prompt, chat) for prompt, chat in dict.fromkeys(requests)]
    expected = dict(zip(dict.fromkeys(requests), expected))
    before = [completed(s) for s in replicas]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda r: complete(router.url, *r), requests))
    for (prompt, chat), answer in zip(requests, answers):
        assert answer == expected[prompt, chat], (prompt, chat)
    taken = [completed(s) - b for s, b in zip(replicas, before)]
    assert sum(taken) == len(requests), (taken, router.log())
    assert all(t > 0 for t in taken), f"a replica took no work: {taken}\n{router.log()}"


def test_kv_aware_router_sends_a_prefix_to_the_replica_that_caches_it(replicas, start_router):
    args = ["--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", MODEL]
    for server in replicas:
        args += ["--kv-event-source", f"{server.url}={server.kv_endpoint}"]
    router = start_router(*args, env={"VLLM_ROUTER_TOKENIZER": default_model_path()})
    # each replica caches a prompt of its own (published as BlockStored events), sent to it directly: a
    # completion on the first, a chat on the second
    cases = [(f"{topic} wrote a letter. {OPENING}{OPENING}", chat)
             for topic, chat in (("Jane", False), ("Lydia", True))]
    expected = []
    for server, (prompt, chat) in zip(replicas, cases):
        complete(server.url, prompt, chat)
        expected.append(complete(server.url, prompt + " Then", chat))
    time.sleep(0.5)  # the events reach the router's index
    for _ in range(2):
        for owner, (prompt, chat) in enumerate(cases):
            before = [(completed(s), s.metrics()["hybridserve:prefix_cache_hits_total"]) for s in replicas]
            assert complete(router.url, prompt + " Then", chat) == expected[owner]
            after = [(completed(s), s.metrics()["hybridserve:prefix_cache_hits_total"]) for s in replicas]
            assert [a[0] - b[0] for a, b in zip(after, before)] == [int(i == owner) for i in range(2)], router.log()
            assert after[owner][1] - before[owner][1] >= 48  # it resumed from the cached prefix (3 blocks at least)
