"""Completions' ``echo`` and ``text_offset``: each prompt's text, its tokens' strings, and where each token
(of the prompt or of a completion) starts in the text.

Everything here runs in the tokenizer's own thread (see ``tokenizer_worker.py``): it decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.engine.detokenizer import Detokenizer


@dataclass
class PromptEcho:
    """What ``echo`` returns of one prompt before its completion."""

    text: str  # the prompt as given, or its token ids decoded
    tokens: list[str]  # each prompt token's own string (as logprobs name tokens)
    offsets: list[int]  # where each token starts in ``text`` (see :func:`token_offsets`)


class OffsetTracker:
    """Where each token of one growing sequence starts in its decoded text: the length of the text its
    predecessors decode to. A token ending inside a multi-byte character adds nothing until the character
    is complete, so the tokens of one character share its offset; skipped special tokens add nothing."""

    def __init__(self, detokenizer: Detokenizer, skip_special_tokens: bool, start: int = 0) -> None:
        self.decoder = detokenizer.incremental(skip_special_tokens)
        self.length = start  # offsets are counted from here (after an echoed prompt)
        self.seen = 0

    def advance(self, token_ids: list[int], upto: int) -> list[int]:
        """The offsets of tokens ``seen..upto - 1`` of ``token_ids`` (the whole sequence so far)."""
        offsets = []
        for i in range(self.seen, upto):
            offsets.append(self.length)
            self.length += len(self.decoder.add(token_ids[:i + 1]))
        self.seen = max(self.seen, upto)
        return offsets


def token_offsets(detokenizer: Detokenizer, token_ids: list[int], skip_special_tokens: bool,
                  start: int = 0) -> list[int]:
    """The offset of each token in ``decode(token_ids)`` (see :class:`OffsetTracker`), plus ``start``."""
    return OffsetTracker(detokenizer, skip_special_tokens, start).advance(token_ids, len(token_ids))


def echo_prompts(detokenizer: Detokenizer, prompts: list[tuple[list[int], str | None]],
                 skip_special_tokens: bool) -> list[PromptEcho]:
    """The echo of each ``(token ids, text or None)`` prompt. A text prompt is echoed as given (its offsets
    index its decoded tokens, which spell it whenever the tokenizer round-trips it); token ids are decoded."""
    echoes = []
    for ids, text in prompts:
        if text is None:
            text = detokenizer.decode(ids, skip_special_tokens)
        if detokenizer.tokenizer is None:
            tokens = [f"token_id:{t}" for t in ids]  # as serving_common.token_str names an undecoded token
        else:
            tokens = [detokenizer.decode([t], False) for t in ids]  # as Detokenizer.annotate names them
        echoes.append(PromptEcho(text, tokens, token_offsets(detokenizer, ids, skip_special_tokens)))
    return echoes
