"""``GET /metrics``: the engine's gauges, counters and latency histograms in Prometheus text format."""

from __future__ import annotations

from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.metrics import Histogram
from hybridserve.kernels import fallbacks

PREFIX = "hybridserve:"


def _label(model_name: str) -> str:
    return f'model_name="{_escape(model_name)}"'


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _scalar(lines: list[str], name: str, kind: str, help_text: str, label: str, value: float) -> None:
    lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}",
              f"{PREFIX}{name}{{{label}}} {_num(value)}"]


def _histogram(lines: list[str], name: str, help_text: str, label: str, hist: Histogram) -> None:
    buckets, total, count = hist.collect()
    lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} histogram"]
    for bound, cumulative in buckets:
        lines.append(f'{PREFIX}{name}_bucket{{{label},le="{_num(bound)}"}} {cumulative}')
    lines += [f"{PREFIX}{name}_sum{{{label}}} {_num(total)}", f"{PREFIX}{name}_count{{{label}}} {count}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _kernel_fallbacks(lines: list[str], label: str) -> None:
    name = f"{PREFIX}kernel_fallbacks_total"
    lines += [f"# HELP {name} Calls a layer ran in plain PyTorch while its CPU kernels were on, by op and reason.",
              f"# TYPE {name} counter"]
    for (op, reason), count in sorted(fallbacks.counts().items()):
        lines.append(f'{name}{{{label},op="{_escape(op)}",reason="{_escape(reason)}"}} {count}')


def _prefix_cache(lines: list[str], label: str, stats: dict[str, int]) -> None:
    if not stats:
        return
    _scalar(lines, "prefix_cache_queries_total", "counter",
            "Prompt tokens looked up in the prefix cache.", label, stats["queries"])
    _scalar(lines, "prefix_cache_hits_total", "counter",
            "Prompt tokens resumed from the prefix cache instead of computed.", label, stats["hits"])
    _scalar(lines, "prefix_cache_kv_beyond_snapshot_total", "counter",
            "Lookups whose cached KV reached further than any recurrent-state snapshot (the shortfall "
            "is computed, and a snapshot is taken at the divergence point for the next request).",
            label, stats["kv_beyond_snapshot"])
    _scalar(lines, "prefix_cache_snapshots", "gauge", "Recurrent-state snapshots held by the prefix cache.",
            label, stats["snapshots"])
    _scalar(lines, "prefix_cache_snapshot_bytes", "gauge", "Pool bytes of the prefix cache's state snapshots.",
            label, stats["snapshot_bytes"])
    _scalar(lines, "prefix_cache_bytes", "gauge",
            "Pool bytes held only by the prefix cache (KV pages and snapshots; evicted whenever requests need them).",
            label, stats["cached_bytes"])
    _scalar(lines, "prefix_cache_evictions_total", "counter", "Cached pages and snapshots evicted.",
            label, stats["evicted_pages"] + stats["evicted_snapshots"])


def render_metrics(engine: AsyncEngine, model_name: str) -> str:
    snap = engine.snapshot
    label = _label(model_name)
    lines: list[str] = []
    _scalar(lines, "num_requests_running", "gauge", "Requests running in the engine (prefilling or decoding).",
            label, snap.num_requests_running)
    _scalar(lines, "num_requests_waiting", "gauge", "Requests accepted and waiting to run.",
            label, engine.num_waiting())
    _scalar(lines, "cache_usage_perc", "gauge",
            "Fraction of the KV + state cache pool held by requests (1 means 100 percent).", label, snap.cache_usage)
    _scalar(lines, "prompt_tokens_total", "counter", "Prompt tokens of the requests accepted.",
            label, snap.prompt_tokens)
    _scalar(lines, "generation_tokens_total", "counter", "Tokens generated.", label, snap.generation_tokens)
    _scalar(lines, "num_preemptions_total", "counter", "Sequences preempted (their cache freed, to be recomputed).",
            label, snap.num_preemptions)
    _prefix_cache(lines, label, snap.prefix_cache)
    _kernel_fallbacks(lines, label)
    _histogram(lines, "time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
               label, engine.ttft)
    _histogram(lines, "inter_token_latency_seconds", "Seconds between successive tokens of a request.",
               label, engine.itl)
    return "\n".join(lines) + "\n"
