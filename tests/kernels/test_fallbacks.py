"""Loud fallbacks (``kernels/fallbacks.py``): counted per op and reason, logged once each, exported on
``/metrics``."""

from __future__ import annotations

import logging
import uuid

import torch
from prometheus_client import CollectorRegistry, generate_latest

from hybridserve.entrypoints.openai.metrics import METRICS, EngineCollector
from hybridserve.kernels import fallbacks


def test_counted_per_op_and_reason_and_logged_once(caplog):
    op = f"test_op_{uuid.uuid4().hex}"  # new to this process
    total = fallbacks.total()
    with caplog.at_level(logging.WARNING, logger="hybridserve.kernels.fallbacks"):
        for _ in range(3):
            fallbacks.record(op, "bfloat16 strided")
        fallbacks.record(op, "float32 rows")
    counts = fallbacks.counts()
    assert counts[(op, "bfloat16 strided")] == 3 and counts[(op, "float32 rows")] == 1
    assert fallbacks.total() == total + 4
    logged = [r.getMessage() for r in caplog.records if op in r.getMessage()]
    assert len(logged) == 2 and all("plain PyTorch" in m for m in logged)  # once per (op, reason)


def test_describe_names_dtypes_and_layouts():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert fallbacks.describe(x, None, x.t()) == "bfloat16 rows, bfloat16 strided"
    assert fallbacks.describe() == "not covered"


def test_metrics_lines():
    fallbacks.record("metrics_op", 'a "quoted" reason')
    registry = CollectorRegistry()
    registry.register(EngineCollector(None, "m", rows=tuple(r for r in METRICS if r.name == "kernel_fallbacks_total")))
    lines = generate_latest(registry).decode().splitlines()
    assert lines[1] == "# TYPE hybridserve:kernel_fallbacks_total counter"
    assert any(line.startswith('hybridserve:kernel_fallbacks_total{model_name="m",op="metrics_op",'
                               'reason="a \\"quoted\\" reason"} ') for line in lines)
