"""The stop check: whether a sequence ends after the token it just appended, from the sequence alone."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Stop:
    """Why a sequence ends: ``reason`` "stop" or "length"; ``stop_reason`` the stop token id or stop string
    that ended it (None for EOS, a complete grammar or a length); ``text_end`` where its output text is cut
    (a stop string: the text is final there), None when the output's tokens are decoded as its text; ``by_eos``:
    an end-of-sequence token ended it (that token is not part of the text)."""

    reason: str
    stop_reason: int | str | None = None
    text_end: int | None = None
    by_eos: bool = False


def check_stop(seq: Sequence, text_before: int, grammar_finished: bool, max_model_len: int) -> Stop | None:
    """How ``seq`` ends after its last output token, or None when it goes on.

    ``text_before``: the length of its output text before that token (a stop string is searched for in the
    text the token added, ``seq.output_text`` decoded up to it when the params have stop strings);
    ``grammar_finished``: its grammar admits no further token. Pure: it reads ``seq`` and changes nothing.
    """
    params = seq.params
    num_out = len(seq.output_token_ids)
    token = seq.output_token_ids[-1]
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token in seq.eos_token_ids:
            return Stop("stop", by_eos=True)
        if params.stop_token_ids and token in params.stop_token_ids:
            return Stop("stop", token)
        for stop in params.stop_strings:
            start = max(0, text_before - len(stop))
            pos = seq.output_text.find(stop, start)
            if pos >= 0:
                return Stop("stop", stop, pos + len(stop) if params.include_stop_str_in_output else pos)
    if grammar_finished:  # the grammar is complete: nothing but EOS could follow
        return Stop("stop")
    if (params.max_tokens is not None and num_out >= params.max_tokens) or seq.num_tokens >= max_model_len:
        return Stop("length")
    return None
