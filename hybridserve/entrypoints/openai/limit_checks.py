"""The per-request limits, enforced: counts on the raw JSON body (before validation builds anything
from it, so validation work is bounded too), and ``n`` x prompts once ``n`` is known."""

from __future__ import annotations

from typing import Any

from hybridserve.entrypoints.openai.errors import APIError
from hybridserve.entrypoints.openai.limits import ServerLimits


def _at_most(limits: ServerLimits, name: str, count: int, param: str, subject: str) -> None:
    if count > getattr(limits, name):
        raise APIError(400, limits.exceeded(name, subject), param=param)


def check_counts(data: Any, limits: ServerLimits) -> None:
    """Prompts, chat messages (and their text parts), stop strings (count and length) and stop token ids.

    Values of the wrong type are left to validation, which refuses them.
    """
    if not isinstance(data, dict):
        return
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # not one token-id prompt
        _at_most(limits, "max_prompts", len(prompt), "prompt", f"prompt has {len(prompt):,} prompts")
    messages = data.get("messages")
    if isinstance(messages, list):
        _at_most(limits, "max_messages", len(messages), "messages", f"messages has {len(messages):,} messages")
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        _at_most(limits, "max_messages", parts, "messages", f"the messages have {parts:,} content parts")
    stop = data.get("stop")
    if isinstance(stop, list):
        _at_most(limits, "max_stop_strings", len(stop), "stop", f"stop has {len(stop):,} strings")
    for i, s in enumerate([stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []):
        if isinstance(s, str):
            which = "the stop string" if isinstance(stop, str) else f"stop string {i}"
            _at_most(limits, "max_stop_chars", len(s), "stop", f"{which} has {len(s):,} characters")
    stop_ids = data.get("stop_token_ids")
    if isinstance(stop_ids, list):
        _at_most(limits, "max_stop_token_ids", len(stop_ids), "stop_token_ids",
                 f"stop_token_ids has {len(stop_ids):,} entries")


def check_completions(limits: ServerLimits, n: int, num_prompts: int) -> None:
    """``n`` per prompt, and ``n`` x prompts per request (``n`` below 1 is left to SamplingParams)."""
    _at_most(limits, "max_n", n, "n", f"n={n}")
    _at_most(limits, "max_completions", n * num_prompts, "n",
             f"n={n} for {num_prompts:,} prompts asks for {n * num_prompts:,} completions")
