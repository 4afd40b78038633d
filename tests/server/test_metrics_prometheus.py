"""``/metrics`` read with prometheus_client's own parsers: two servers in one process keep separate registries,
counters move by exactly what known requests did, an OpenMetrics scraper gets OpenMetrics, and HEAD works."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.config import EngineConfig
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.api_server import build_app
from hybridserve.entrypoints.openai.metrics import Labeled, Scalar
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from tests.server.server_utils import make_checkpoint, wait_for

NAMES = ("alpha", "beta")
TYPES = {"num_requests_running": "gauge", "num_requests_waiting": "gauge", "cache_usage_perc": "gauge",
         "request_success_total": "counter",
         "prompt_tokens_total": "counter", "generation_tokens_total": "counter", "num_preemptions_total": "counter",
         "prefix_cache_queries_total": "counter", "prefix_cache_lookups_total": "counter",
         "prefix_cache_hits_total": "counter",
         "prefix_cache_kv_beyond_snapshot_total": "counter", "prefix_cache_snapshots": "gauge",
         "prefix_cache_snapshot_bytes": "gauge", "prefix_cache_bytes": "gauge",
         "prefix_cache_evictions_total": "counter", "kernel_fallbacks_total": "counter",
         "cpu_threads": "gauge", "cpu_thread_changes_total": "counter",
         "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram"}


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """Two in-process servers (``alpha``, ``beta``) on engines of their own, lifespans running."""
    path = make_checkpoint(str(tmp_path_factory.mktemp("metrics") / "bamba"))
    opened = {}
    try:
        for name in NAMES:
            engine = LLMEngine(EngineConfig(model=path, cache_memory="8MiB", enable_progress_bar=False))
            state = ServerState(engine=AsyncEngine(engine), tokenizer=TokenizerWorker(path, engine.max_model_len),
                                model_name=name, max_model_len=engine.max_model_len)
            client = TestClient(build_app(state), base_url="http://localhost")
            client.__enter__()
            opened[name] = client
        yield opened
    finally:
        for client in opened.values():
            client.__exit__(None, None, None)


def scrape(client: TestClient) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """``/metrics`` parsed by prometheus_client: ({family: type}, {(sample name, sorted labels): value})."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = {}, {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def value(samples: dict, name: str, model: str, **labels: str) -> float:
    return samples[("hybridserve:" + name, tuple(sorted({"model_name": model, **labels}.items())))]


def idle(client: TestClient, model: str) -> bool:
    _, s = scrape(client)
    return value(s, "num_requests_running", model) == 0 and value(s, "num_requests_waiting", model) == 0


def test_families_types_and_labels(clients):
    for name, client in clients.items():
        # the prefix cache's families appear with the engine thread's first snapshot
        wait_for(lambda c=client: "hybridserve:prefix_cache_queries" in scrape(c)[0], what="the first snapshot")
        types, samples = scrape(client)
        # the parser names a counter family without its _total suffix
        assert {f"hybridserve:{k.removesuffix('_total') if v == 'counter' else k}": v for k, v in TYPES.items()} \
            .items() <= types.items()
        assert {dict(labels)["model_name"] for _, labels in samples} == {name}  # each server its own series


def test_counters_move_by_exact_amounts(clients):
    alpha, beta = clients["alpha"], clients["beta"]
    _, before = scrape(alpha)
    _, beta_before = scrape(beta)
    # the streamed request repeats a prompt sent unstreamed, whose usage tells its token count
    requests = [("Hello world", 5, False), ("The quick brown fox", 3, False), ("Hello world", 4, True)]
    prompt_counts: dict[str, int] = {}
    for prompt, max_tokens, stream in requests:
        r = alpha.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                                "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.json()["usage"]["completion_tokens"] == max_tokens
            prompt_counts[prompt] = r.json()["usage"]["prompt_tokens"]
    prompt_tokens = sum(prompt_counts[prompt] for prompt, _, _ in requests)
    generated = sum(max_tokens for _, max_tokens, _ in requests)
    wait_for(lambda: idle(alpha, "alpha"), what="alpha to go idle")
    _, after = scrape(alpha)

    def delta(name: str) -> float:
        return value(after, name, "alpha") - value(before, name, "alpha")

    assert delta("request_success_total") == len(requests)
    assert delta("prompt_tokens_total") == prompt_tokens
    assert delta("generation_tokens_total") == generated
    assert delta("time_to_first_token_seconds_count") == len(requests)  # one first token per request
    assert delta("inter_token_latency_seconds_count") == generated - len(requests)  # every later token
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        count = value(after, hist + "_count", "alpha")
        assert value(after, hist + "_bucket", "alpha", le="+Inf") == count and delta(hist + "_sum") > 0
    assert value(after, "cache_usage_perc", "alpha") == 0
    # the engine thread runs the count the engine set (inherited from this thread); fixed without adaptive threads
    assert value(after, "cpu_threads", "alpha") == torch.get_num_threads()
    assert value(after, "cpu_thread_changes_total", "alpha") == 0
    _, beta_after = scrape(beta)

    def engine_own(samples: dict) -> dict:  # kernel fallbacks are counted per process, not per engine
        return {k: v for k, v in samples.items() if not k[0].startswith("hybridserve:kernel_fallbacks")}

    assert engine_own(beta_after) == engine_own(beta_before)  # the other server saw none of it


def test_openmetrics_when_asked(clients):
    r = clients["alpha"].get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    families = {f.name: f for f in parse_openmetrics(r.text)}  # the parser requires the closing "# EOF"
    assert families["hybridserve:generation_tokens"].type == "counter"
    assert families["hybridserve:time_to_first_token_seconds"].type == "histogram"


def test_head_answers_like_get(clients):
    """Scrapers probe /metrics with HEAD before scraping (aiperf does): 200 with GET's Content-Type, not 405."""
    r = clients["alpha"].head("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")


@pytest.mark.parametrize("name, kind, error", [
    ("x", "summary", "kind='summary'; allowed"), ("x", "counter", "ends in _total"),
    ("x_total", "gauge", "ends in _total"),
])
def test_rows_refuse_bad_kinds_and_names(name, kind, error):
    with pytest.raises(ValueError, match=error):
        Scalar(name, kind, "help", lambda e: 0)
    with pytest.raises(ValueError, match=error):
        Labeled(name, kind, "help", ("op",), lambda e: {})
