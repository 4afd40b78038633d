"""``GET /metrics``: the engine's gauges, counters and latency histograms, exposed with prometheus_client.

Every metric is one row of :data:`METRICS`: its name after the ``hybridserve:`` prefix, its help text and a
function that reads its value from the :class:`AsyncEngine` at scrape time (the engine counts in plain Python,
see ``engine/metrics.py``; this module only exposes). Each series carries the ``model_name`` label. Adding a
metric is adding a row; a row whose reader returns ``None`` is left out of that scrape.

Each server has its own :class:`~prometheus_client.CollectorRegistry` (:func:`metrics_registry`), so several
servers in one process never share or clash on series. :func:`render` writes Prometheus text (format 0.0.4), or
OpenMetrics when the scraper's ``Accept`` header asks for it.

The prefix cache's answers are counted by reason (``cache/prefix_reason.py``). ``salted`` (a prompt that only
another ``cache_salt`` has cached) is shown only when ``/metrics`` needs the API key
(``--protect-metrics-and-docs``); an open ``/metrics`` counts those lookups as ``no_match``, what the request
itself was told, so that no client can learn from it what another salt has cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hybridserve.cache.prefix_reason import PrefixCacheReason
from hybridserve.engine.metrics import CountsHistogram
from hybridserve.kernels import fallbacks

if TYPE_CHECKING:
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.engine.metrics import Histogram

PREFIX = "hybridserve:"
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def _check_kind(name: str, kind: str) -> None:
    if kind not in _FAMILIES:
        raise ValueError(f"metric {name!r}: kind={kind!r}; allowed: {sorted(_FAMILIES)}")
    if (kind == "counter") != name.endswith("_total"):
        raise ValueError(f"metric {name!r}: a counter's name ends in _total, and only a counter's")


@dataclass(frozen=True)
class Scalar:
    """A counter or gauge with one value (``read(engine)``; None: not exposed now)."""

    name: str
    kind: str  # "counter" (name ends in _total) or "gauge"
    help: str
    read: Callable[[AsyncEngine], float | None]

    def __post_init__(self) -> None:
        _check_kind(self.name, self.kind)

    def family(self, engine: AsyncEngine, model_name: str) -> Metric | None:
        value = self.read(engine)
        if value is None:
            return None
        family = _FAMILIES[self.kind](PREFIX + self.name, self.help, labels=["model_name"])
        family.add_metric([model_name], value)
        return family


@dataclass(frozen=True)
class Labeled:
    """A counter or gauge with one value per combination of extra labels (``read(engine)``: {values: count})."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    read: Callable[[AsyncEngine], Mapping[tuple[str, ...], float]]

    def __post_init__(self) -> None:
        _check_kind(self.name, self.kind)

    def family(self, engine: AsyncEngine, model_name: str) -> Metric:
        family = _FAMILIES[self.kind](PREFIX + self.name, self.help, labels=["model_name", *self.labels])
        for values, count in sorted(self.read(engine).items()):
            family.add_metric([model_name, *values], count)
        return family


@dataclass(frozen=True)
class Hist:
    """A histogram the engine keeps (``read(engine)``: an ``engine.metrics.Histogram``)."""

    name: str
    help: str
    read: Callable[[AsyncEngine], Histogram | CountsHistogram | None]  # None: not exposed now

    def family(self, engine: AsyncEngine, model_name: str) -> Metric | None:
        histogram = self.read(engine)
        if histogram is None:
            return None
        buckets, total, _ = histogram.collect()
        family = HistogramMetricFamily(PREFIX + self.name, self.help, labels=["model_name"])
        family.add_metric([model_name], [(floatToGoString(bound), count) for bound, count in buckets], total)
        return family


def _prefix_cache(*keys: str) -> Callable[[AsyncEngine], float | None]:
    """Reads the sum of ``keys`` of the prefix cache's stats (None before the engine's first snapshot)."""

    def read(engine: AsyncEngine) -> float | None:
        stats = engine.snapshot.prefix_cache
        return sum(stats[key] for key in keys) if stats else None

    return read


def _by_reason(kind: str, show_salted: bool) -> Callable[[AsyncEngine], dict[tuple[str, ...], float]]:
    """Reads the prefix cache's ``kind`` (``lookups`` or ``queries``) counts by reason; ``salted`` folded into
    ``no_match`` unless ``show_salted`` (nothing before the engine's first snapshot)."""

    def read(engine: AsyncEngine) -> dict[tuple[str, ...], float]:
        stats = engine.snapshot.prefix_cache
        if not stats:
            return {}
        counts = {reason.value: stats.get(f"{kind}:{reason.value}", 0) for reason in PrefixCacheReason}
        if not show_salted:
            counts[PrefixCacheReason.NO_MATCH.value] += counts.pop(PrefixCacheReason.SALTED.value)
        return {(reason,): count for reason, count in counts.items()}

    return read


def _spec_decode(key: str) -> Callable[[AsyncEngine], float | None]:
    """Reads a counter of speculative decoding (None when it is off)."""

    def read(engine: AsyncEngine) -> float | None:
        stats = engine.snapshot.spec_decode
        return stats[key] if stats else None

    return read


def _acceptance_lengths(engine: AsyncEngine) -> CountsHistogram | None:
    stats = engine.snapshot.spec_decode
    return CountsHistogram(stats["accepted_length_counts"]) if stats else None


Row = Scalar | Labeled | Hist

METRICS: tuple[Row, ...] = (
    Scalar("num_requests_running", "gauge", "Requests running in the engine (prefilling or decoding).",
           lambda e: e.snapshot.num_requests_running),
    Scalar("num_requests_waiting", "gauge", "Requests accepted and waiting to run.", lambda e: e.num_waiting()),
    Scalar("cache_usage_perc", "gauge", "Fraction of the KV + state cache pool held by requests (1 means 100 percent).",
           lambda e: e.snapshot.cache_usage),
    Scalar("request_success_total", "counter", "Requests that finished without an error (aborted ones not counted).",
           lambda e: e.num_requests_finished),
    Scalar("prompt_tokens_total", "counter", "Prompt tokens of the requests accepted.",
           lambda e: e.snapshot.prompt_tokens),
    Scalar("generation_tokens_total", "counter", "Tokens generated.", lambda e: e.snapshot.generation_tokens),
    Scalar("num_preemptions_total", "counter", "Sequences preempted (their cache freed, to be recomputed).",
           lambda e: e.snapshot.num_preemptions),
    Scalar("prefix_cache_hits_total", "counter", "Prompt tokens resumed from the prefix cache instead of computed.",
           _prefix_cache("hits")),
    Scalar("prefix_cache_kv_beyond_snapshot_total", "counter",
           "Lookups whose cached KV reached further than any recurrent-state snapshot (the shortfall is computed, "
           "and a snapshot is taken at the divergence point for the next request).",
           _prefix_cache("kv_beyond_snapshot")),
    Scalar("prefix_cache_snapshots", "gauge", "Recurrent-state snapshots held by the prefix cache.",
           _prefix_cache("snapshots")),
    Scalar("prefix_cache_snapshot_bytes", "gauge", "Pool bytes of the prefix cache's state snapshots.",
           _prefix_cache("snapshot_bytes")),
    Scalar("prefix_cache_bytes", "gauge",
           "Pool bytes held only by the prefix cache (KV pages and snapshots; evicted whenever requests need them).",
           _prefix_cache("cached_bytes")),
    Scalar("prefix_cache_evictions_total", "counter", "Cached pages and snapshots evicted.",
           _prefix_cache("evicted_pages", "evicted_snapshots")),
    Scalar("cpu_threads", "gauge", "Compute threads the engine runs with now (lowered while other processes want "
           "the cores, with --cpu-adaptive-threads).", lambda e: e.snapshot.cpu_threads),
    Scalar("cpu_thread_changes_total", "counter", "Thread count changes made by --cpu-adaptive-threads.",
           lambda e: e.snapshot.cpu_thread_changes),
    Labeled("kernel_fallbacks_total", "counter",
            "Calls a layer ran in plain PyTorch while its CPU kernels were on, by op and reason.",
            ("op", "reason"), lambda e: fallbacks.counts()),
    Scalar("spec_decode_num_drafts_total", "counter", "Speculative verifications (a sequence's drafts checked in "
           "one forward).", _spec_decode("num_drafts")),
    Scalar("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed and verified.",
           _spec_decode("num_draft_tokens")),
    Scalar("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
           _spec_decode("num_accepted_tokens")),
    Hist("spec_decode_acceptance_length", "Draft tokens accepted per verification (0 to num_speculative_tokens).",
         _acceptance_lengths),
    Hist("time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", lambda e: e.ttft),
    Hist("inter_token_latency_seconds", "Seconds between successive tokens of a request.", lambda e: e.itl),
)


def prefix_reason_rows(show_salted: bool) -> tuple[Row, ...]:
    """The prefix cache's counters by reason (``salted`` shown or folded into ``no_match``, see above)."""
    return (
        Labeled("prefix_cache_queries_total", "counter",
                "Prompt tokens looked up in the prefix cache, by the lookup's outcome (hit, no_match, no_snapshot, "
                "evicted, salted, caching_off, too_short, prompt_logprobs).", ("reason",),
                _by_reason("queries", show_salted)),
        Labeled("prefix_cache_lookups_total", "counter",
                "Prompts looked up in the prefix cache (one per admission of a request's prompt), by outcome.",
                ("reason",), _by_reason("lookups", show_salted)),
    )


class EngineCollector(Collector):
    """Reads ``rows`` (default :data:`METRICS` and the prefix cache's counters by reason, ``salted`` folded) from
    ``engine`` on every scrape, labelled ``model_name``."""

    def __init__(self, engine: AsyncEngine, model_name: str, rows: tuple[Row, ...] | None = None) -> None:
        self.engine, self.model_name = engine, model_name
        self.rows = rows if rows is not None else METRICS + prefix_reason_rows(False)

    def collect(self) -> Iterator[Metric]:
        for row in self.rows:
            family = row.family(self.engine, self.model_name)
            if family is not None:
                yield family


def metrics_registry(engine: AsyncEngine, model_name: str, show_salted: bool = False) -> CollectorRegistry:
    """A registry of its own for one server, holding the engine's metrics (``show_salted``: only for a
    ``/metrics`` that needs the API key)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, model_name, METRICS + prefix_reason_rows(show_salted)))
    return registry


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry's metrics and their Content-Type, in the format the scraper's ``Accept`` header asks for:
    OpenMetrics or Prometheus text (0.0.4 when it names none)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
