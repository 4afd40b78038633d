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


def response_entries(n: int, prompt_lengths: list[int], echo: bool, max_tokens: int | None, max_model_len: int,
                     top_logprobs: int | None) -> tuple[int, int, int]:
    """The most entries a response can hold, and its echoed and generated tokens (each counted once, not per
    completion): every returned token counts once, plus its ``top_logprobs`` entries when logprobs are asked for,
    in each of the ``n`` completions of every prompt. ``max_tokens=None`` (up to ``max_model_len``) and a
    ``max_tokens`` past what fits count what fits: a prompt that does not fit is refused later, by its length."""
    echoed = sum(prompt_lengths) if echo else 0
    generated = 0
    for length in prompt_lengths:
        room = max(0, max_model_len - length)
        generated += room if max_tokens is None else min(max_tokens, room)
    return n * (echoed + generated) * (1 + (top_logprobs or 0)), echoed, generated


def check_response_size(limits: ServerLimits, n: int, prompt_lengths: list[int], echo: bool, max_tokens: int | None,
                        max_model_len: int, top_logprobs: int | None, logprobs_field: str = "logprobs") -> None:
    """A 400 for a request whose response could hold more than ``--max-response-entries`` entries (see
    :func:`response_entries`), before anything is queued; the message names the figure and what it is made of."""
    entries, echoed, generated = response_entries(n, prompt_lengths, echo, max_tokens, max_model_len, top_logprobs)
    if entries <= limits.max_response_entries:
        return
    prompts = f" over {len(prompt_lengths):,} prompts" if len(prompt_lengths) > 1 else ""
    tokens = f"{echoed:,} echoed prompt tokens + {generated:,} generated" if echo else f"{generated:,} generated"
    per_token = f" x (1 + {logprobs_field}={top_logprobs})" if top_logprobs else ""
    subject = f"the response could hold {entries:,} entries (n={n} x ({tokens}{prompts}){per_token})"
    advice = f"lower n, max_tokens{', echo' if echo else ''}{' or ' + logprobs_field if top_logprobs else ''}"
    raise APIError(400, f"{limits.exceeded('max_response_entries', subject)}; {advice}", param=None)
