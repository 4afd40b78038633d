"""Thread-safe Prometheus-style histogram in plain Python (the engine needs no prometheus_client); the server's
``/metrics`` (``entrypoints/openai/metrics.py``) reads it at scrape time."""

from __future__ import annotations

import bisect
import threading


class Histogram:
    """Cumulative-bucket histogram of observations (seconds), safe to observe and read from any thread."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last: above every bucket (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def collect(self) -> tuple[list[tuple[float, int]], float, int]:
        """``([(upper bound, cumulative count), ..., (inf, count)], sum, count)``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, acc = [], 0
        for bound, c in zip((*self.buckets, float("inf")), counts):
            acc += c
            cumulative.append((bound, acc))
        return cumulative, total, acc


class CountsHistogram:
    """A histogram of small whole numbers given as counts (``counts[v]``: observations of value ``v``), read
    through the same ``collect`` as :class:`Histogram` (buckets at 0, 1, ..., len(counts) - 1)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = list(counts)

    def collect(self) -> tuple[list[tuple[float, int]], float, int]:
        cumulative, acc = [], 0
        for value, count in enumerate(self.counts):
            acc += count
            cumulative.append((float(value), acc))
        cumulative.append((float("inf"), acc))
        return cumulative, float(sum(v * c for v, c in enumerate(self.counts))), acc
