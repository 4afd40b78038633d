"""The thinking-tag reasoning format (Qwen3, DeepSeek-R1, Nemotron reasoning variants): the reasoning is
``<think>...</think>`` at the start of the output (or the chat template opens ``<think>`` at the end of the
prompt and the output begins inside it); what follows ``</think>`` is the reply. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.tool_parsers.base import TagRenderer, partial_suffix


@dataclass
class ReasoningSplit:
    """``reasoning`` and ``content`` of an output so far; ``ended``: the reasoning is over (or there is none)."""

    reasoning: str
    content: str
    ended: bool


class ThinkTagReasoningParser:
    """Splits ``<think>reasoning</think>content``. An output that does not start with the start tag (and did not
    begin inside reasoning) has no reasoning; one whose reasoning never ends is all reasoning."""

    name = "think"

    def __init__(self, start_tag: str = "<think>", end_tag: str = "</think>") -> None:
        self.start_tag, self.end_tag = start_tag, end_tag

    def prompt_state(self, prompt_text: str) -> str:
        """Where the output begins, from the rendered prompt: ``"inside"`` (the prompt ends with an open start tag),
        ``"after"`` (the prompt ends with a closed reasoning block: none is generated) or ``"before"``."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.start_tag):
            return "inside"
        if tail.endswith(self.end_tag):
            return "after"
        return "before"

    def split(self, text: str, state: str, final: bool) -> ReasoningSplit:
        """Split the output ``text`` (``state``: :meth:`prompt_state` of its prompt). While streaming (not
        ``final``), a tail that may be the start of a tag is held back."""
        if state == "after":
            return ReasoningSplit("", text, True)
        start = 0
        if state == "before":
            lead = len(text) - len(text.lstrip())
            rest = text[lead:]
            if not rest.startswith(self.start_tag):
                if not final and (not rest or self.start_tag.startswith(rest)):
                    return ReasoningSplit("", "", False)  # may still become the start tag
                return ReasoningSplit("", text, True)
            start = lead + len(self.start_tag)
        end = text.find(self.end_tag, start)
        if end < 0:
            shown = text[start:] if final else text[start:len(text) - partial_suffix(text[start:], self.end_tag)]
            return ReasoningSplit(shown, "", final)
        return ReasoningSplit(text[start:end], text[end + len(self.end_tag):].lstrip(), True)

    def grammar_prefix(self, state: str, tag: TagRenderer) -> tuple[str, str] | None:
        """The Lark expression of the reasoning before a constrained reply, and the definitions it needs (None:
        the reply starts at once). The reasoning is free text up to the end tag, then optional blank space."""
        if state == "after":
            return None
        if self.end_tag in tag.added_tokens:  # text cannot contain an added token: the tag ends the reasoning
            thinking, defs = f"/(.|\\n)*/ {tag(self.end_tag)}", ""
        else:  # one lexeme: any text up to and including the first end tag
            body = _regex_escape(self.end_tag)
            thinking, defs = "THINKING", f"THINKING: /(?s:.*{body})/ & ~/(?s:.*{body}.+)/\n"
        if state == "before":
            thinking = f"({tag(self.start_tag)} {thinking})?"
        return f"{thinking} /[ \\n]*/", defs


_REGEX_SPECIAL = set(".^$*+?()[]{}|\\/-&~")


def _regex_escape(text: str) -> str:
    """``text`` as a regex that matches it literally (within llguidance's ``/.../``)."""
    return "".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in text)
