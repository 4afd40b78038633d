"""The drift report's figures, from two runs' scores of one token sequence: per position, the |Δlogprob| of the
actual next token and whether the most likely token agrees; per bucket of positions and per phase (prompt,
generated), their mean, max and agreement rate; the report as a text table. Plain Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PHASES = ("prompt", "generated")


@dataclass(frozen=True)
class Scores:
    """One run's scores of a fixed sequence of N tokens. Position ``i`` (1 <= i < N) scores token ``i`` given the
    tokens before it: ``target_logprobs[i - 1]`` is that token's logprob, ``top_token_ids[i - 1]`` the most
    likely token there."""

    target_logprobs: list[float]
    top_token_ids: list[int]


@dataclass(frozen=True)
class Bucket:
    """Positions ``start`` to ``end - 1``, all of one phase."""

    start: int
    end: int
    phase: str


def position_drift(reference: Scores, other: Scores) -> tuple[list[float], list[bool]]:
    """Per position (index ``i - 1`` for position ``i``): |Δlogprob| of the actual next token, and whether the
    two runs' most likely tokens agree."""
    if len(reference.target_logprobs) != len(other.target_logprobs):
        raise ValueError(f"the runs scored {len(reference.target_logprobs)} and {len(other.target_logprobs)} "
                         "positions: they must score the same sequence")
    deltas = [abs(a - b) for a, b in zip(reference.target_logprobs, other.target_logprobs)]
    agree = [a == b for a, b in zip(reference.top_token_ids, other.top_token_ids)]
    return deltas, agree


def position_buckets(prompt_tokens: int, total_tokens: int, size: int) -> list[Bucket]:
    """Positions 1 .. total_tokens - 1 in runs of ``size``: prompt buckets end at multiples of ``size``, generated
    ones start again at the first generated position (``prompt_tokens``), so that no bucket mixes the phases."""
    buckets = []
    for phase, low, high in (("prompt", 1, prompt_tokens), ("generated", prompt_tokens, total_tokens)):
        origin = 0 if phase == "prompt" else prompt_tokens
        start = low
        while start < high:
            end = min(high, origin + ((start - origin) // size + 1) * size)
            buckets.append(Bucket(start, end, phase))
            start = end
    return buckets


def figures(deltas: list[float], agree: list[bool], start: int, end: int) -> dict[str, Any] | None:
    """Mean and max |Δlogprob| and the top-1 agreement rate over positions ``start`` to ``end - 1``; None when
    that range is empty."""
    part, same = deltas[start - 1:end - 1], agree[start - 1:end - 1]
    if not part:
        return None
    return {"positions": len(part), "mean": sum(part) / len(part), "max": max(part),
            "top1_agreement": sum(same) / len(same)}


def summary(deltas: list[float], agree: list[bool], prompt_tokens: int) -> dict[str, Any]:
    """The figures over every position, the prompt's and the generated continuation's (None when it has none)."""
    total = len(deltas) + 1
    return {"all": figures(deltas, agree, 1, total), "prompt": figures(deltas, agree, 1, prompt_tokens),
            "generated": figures(deltas, agree, prompt_tokens, total)}


def _cell(value: float | None) -> str:
    return f"{value:9.2e}" if value is not None else f"{'-':>9s}"


def format_table(report: dict[str, Any]) -> str:
    """The report as text: one row per position bucket, a mean and a max column per state dtype, then the
    prompt / generated / all rows, the top-1 agreement and the state bytes per sequence."""
    names = list(report["state_dtypes"])
    settings = report["settings"]
    lines = [f"|Δlogprob| of the next token against {report['reference_state_dtype']} state: {report['model']}",
             f"{settings['prompt_tokens']} prompt + {settings['generate_tokens']} generated tokens (greedy, "
             f"{report['reference_state_dtype']} state), scored {settings['max_num_batched_tokens']} token(s) per "
             f"step; CPU {report['cpu']['model']} ({report['cpu']['isa_in_force']})", ""]
    head = f"{'positions':>11s} {'phase':9s}" + "".join(f" {name[:19]:>19s}" for name in names)
    lines += [head, f"{'':21s}" + "".join(f" {'mean':>9s} {'max':>9s}" for _ in names)]
    for row in report["buckets"]:
        cells = "".join(f" {_cell(f['mean'])} {_cell(f['max'])}" for f in (row["figures"][n] for n in names))
        lines.append(f"{row['start']:>5d}-{row['end'] - 1:<5d} {row['phase']:9s}{cells}")
    lines.append("")
    for part in ("prompt", "generated", "all"):
        parts = [report["state_dtypes"][n][part] for n in names]
        cells = "".join(f" {_cell(p and p['mean'])} {_cell(p and p['max'])}" for p in parts)
        lines.append(f"{part:>11s} {'':9s}{cells}")
    agreement = "".join(f" {100 * report['state_dtypes'][n]['all']['top1_agreement']:>18.2f}%" for n in names)
    lines.append(f"{'top-1 agreement':>21s}{agreement}")
    state_bytes = "".join(f" {report['state_dtypes'][n]['state_bytes_per_sequence']:>19,d}" for n in names)
    lines.append(f"{'state bytes/seq':>21s}{state_bytes}  (reference: "
                 f"{report['reference']['state_bytes_per_sequence']:,d})")
    return "\n".join(lines)
