"""Faults injected into the engine by tests: a marker temperature that picks the requests to harm."""

from __future__ import annotations

from hybridserve.engine import sampler

MARK = 0.77  # a temperature that the injected faults recognise


def poison_marked_rows(monkeypatch, value: float) -> None:
    """Make the sampling distribution of every row sampled at temperature ``MARK`` all ``value`` (nan, inf)."""
    real = sampler._processed_logits

    def poisoned(logits, params):
        out = real(logits, params)
        for row, p in enumerate(params):
            if p.temperature == MARK:
                out[row] = value
        return out

    monkeypatch.setattr(sampler, "_processed_logits", poisoned)
