"""What every tool-call parser gives: the text around the calls and each call as parsed so far, from the whole
output text (streaming re-reads the growing text; see ``streaming.py``), and the grammar that forces its format
(``tool_choice`` required or named). Standard library only."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from hybridserve.tool_parsers.json_scan import ScannedObject

#: the field holding a call's arguments (``parameters``: the spelling some templates use)
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ToolCallDraft:
    """One call as parsed so far: ``name`` once complete, ``arguments`` the raw JSON text of its arguments so far
    (what is streamed; complete it is the call's ``function.arguments``), ``complete`` once the call has ended."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    """An output split into ``content`` (the text to show; while streaming, without a tail that may begin a call)
    and ``calls``. ``valid``: every call is complete with a name and JSON-object arguments (checked when final)."""

    content: str
    calls: list[ToolCallDraft] = field(default_factory=list)
    valid: bool = True


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the grammar needs it: its name and its parameters' JSON schema."""

    name: str
    parameters: dict


class ToolCallParser(ABC):
    """One model family's tool-call text format."""

    #: the name ``--tool-call-parser`` selects it by
    name: str = ""
    #: the text that opens the calls (a tag: one added token in the families' tokenizers)
    start_tag: str = ""
    #: the text that closes each call, if the format has one
    end_tag: str = ""

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag of the format (what must stay in the decoded text for it to be parsed)."""
        return (self.start_tag, self.end_tag) if self.end_tag else (self.start_tag,)

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Split ``text`` (the output so far; ``final``: the whole output). A final output whose calls do not
        parse is all content, with no calls."""

    @abstractmethod
    def grammar(self, tools: list[ToolSpec], parallel: bool, tag: "TagRenderer") -> str:
        """The Lark rule ``tool_calls`` (llguidance's syntax) whose every output is one call (``parallel``: one or
        more) of one of ``tools``, in this format, arguments valid under the tool's schema."""

    def content_before(self, text: str, final: bool) -> tuple[str, int | None]:
        """The text before the first ``start_tag`` and where the tag starts (None if absent). While streaming,
        a tail that may be the start of the tag is held back."""
        pos = text.find(self.start_tag)
        if pos >= 0:
            return text[:pos], pos
        return (text if final else text[:len(text) - partial_suffix(text, self.start_tag)]), None


class TagRenderer:
    """How a literal is written in a grammar: a text that is one added token of the tokenizer (which llguidance
    matches only as that token) as ``<[id]>``, any other as a quoted string."""

    def __init__(self, added_tokens: dict[str, int]) -> None:
        self.added_tokens = added_tokens

    def __call__(self, text: str) -> str:
        token_id = self.added_tokens.get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def draft_of(text: str, obj: ScannedObject) -> ToolCallDraft:
    """A call from a scanned ``{"name": ..., "arguments": {...}}`` object. The name counts once complete, and
    arguments are shown only after it (OpenAI's streamed calls give the name first)."""
    name = obj.complete_value(text, "name")
    draft = ToolCallDraft(name=name if isinstance(name, str) else None)
    if draft.name is not None:
        for key in ARGUMENT_KEYS:
            raw = obj.value_text(text, key)
            if raw is not None:
                draft.arguments = raw
                break
    draft.complete = obj.end is not None and draft.name is not None
    return draft


def call_is_valid(call: ToolCallDraft) -> bool:
    """Whether a complete call has a name and arguments that are one JSON object."""
    if not call.complete or not call.name:
        return False
    try:
        return isinstance(json.loads(call.arguments or "{}"), dict)
    except ValueError:
        return False


def finish(content: str, calls: list[ToolCallDraft], text: str, final: bool) -> ParsedOutput:
    """``ParsedOutput`` of a parse; a final one whose calls are not all valid is the whole text as content."""
    if final and (not calls or not all(call_is_valid(c) for c in calls)):
        return ParsedOutput(content=text, calls=[], valid=not calls)
    for c in calls:
        if final and not c.arguments:
            c.arguments = "{}"
    return ParsedOutput(content=content, calls=calls)


def call_rule(tag: TagRenderer, tools: list[ToolSpec]) -> str:
    """The Lark alternatives of one ``{"name": "<tool>", "arguments": <its schema>}`` object (compact JSON)."""
    options = []
    for tool in tools:
        schema = dict(tool.parameters) if tool.parameters else {"type": "object"}
        schema.setdefault("x-guidance", {"whitespace_flexible": False})
        head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        options.append(f"{head} %json{json.dumps(schema)} \"}}\"")
    return " | ".join(f"({o})" for o in options)
