"""Engines compared step by step: the same requests on each engine, one engine step at a time in turn.

A host whose memory rate drifts between seconds (a shared VM: up to 1.5x here) biases a comparison of whole
runs made one after the other; alternating single steps puts every engine in the same seconds. Used by
``int4_decode.py --interleave-steps`` and ``state_dtype_generate.py --interleave-steps``.
"""

from __future__ import annotations

import time


def interleaved_steps(engines: dict, prompts: list[list[int]], params, tag: str) -> dict[str, list[float]]:
    """Add every prompt (token ids) with ``params`` to each ``LLMEngine`` in ``engines`` (name -> engine), then
    step the engines in turn, the order reversed every other turn, until all have finished. Returns each
    engine's step times in seconds, in order (its first steps are the prefill)."""
    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{name}-{i}-{time.perf_counter_ns()}", prompt, params)
    times: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    turn = 0
    while any(engines[name].has_unfinished_requests() for name in order):
        for name in (order if turn % 2 == 0 else order[::-1]):
            engine = engines[name]
            if engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        turn += 1
    return times
