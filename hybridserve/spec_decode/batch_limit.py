"""How many running sequences a drafting step may have, chosen from the engine's own step times.

A verification of ``k`` drafts runs ``k + 1`` tokens per sequence. Alone on a CPU that costs about a
decode step (the weights are read once either way), but as a batch grows the step becomes compute-bound
and a verification costs ``r`` times a decode step; it pays only while a verification yields more than
``r`` tokens. At start the engine times its captured steps of 1 and of ``k + 1`` tokens per sequence for
each batch bucket (interleaved replays over padding rows, the fastest of each), and drafting is allowed up
to the largest bucket whose ratio is at most :data:`YIELD_SHARE` of the most a verification yields,
``k + 1``. On the shipped model (Zen 5, k = 5, repeating text, 5.2 to 5.9 tokens a verification) drafting
paid at a ratio of 2.6 (two sequences: 1.15x) and lost at 3.9 (four: 0.78x): the share keeps a margin
below that break-even for drafters that are right less often.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

#: the largest ratio of verification to decode step time drafting is allowed at, as a share of ``k + 1``
YIELD_SHARE = 0.45
#: timed pairs of replays per bucket (decode, verification, interleaved; the fastest of each counts), and the
#: time after which a bucket stops taking more pairs
PAIRS = 5
BUDGET_SECONDS = 0.5


def _ratio(verify, decode) -> float:
    """Fastest verification replay over fastest decode replay, timed in interleaved pairs (over padding rows)."""
    verify.replay(), decode.replay()
    best = [float("inf"), float("inf")]
    deadline = time.perf_counter() + BUDGET_SECONDS
    for _ in range(PAIRS):
        for i, graph in enumerate((verify, decode)):
            start = time.perf_counter()
            graph.replay()
            best[i] = min(best[i], time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best[0] / best[1]


def choose_batch_limit(runner, config) -> int:
    """The automatic ``disable_by_batch_size``: from the runner's captured decode and verification steps,
    or :attr:`~hybridserve.spec_decode.config.SpeculativeConfig.max_batch_size` when they are not captured."""
    q = config.num_speculative_tokens + 1
    decode, verify = runner.captured_decode, runner.captured_steps.get(q)
    if decode is None or verify is None:
        return config.max_batch_size
    bound = YIELD_SHARE * q
    limit, ratios = 0, []
    for rows in sorted(set(decode.graphs) & set(verify.graphs)):
        ratio = _ratio(verify.graphs[rows], decode.graphs[rows])
        ratios.append(f"{rows}: {ratio:.2f}")
        if ratio > bound:
            break
        limit = rows
    limit = max(limit, 1)  # one stream always may: a verification alone is where drafting pays most
    logger.info("speculation drafts in steps of up to %d running sequences (a %d-token verification costs, per batch "
                "size, this many decode steps: %s; the bound is %.1f)", limit, q, ", ".join(ratios), bound)
    return limit
