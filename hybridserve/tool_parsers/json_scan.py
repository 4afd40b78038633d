"""Reading a JSON object or array that may still be growing (a tool call being generated): which fields are
complete, where each value starts and ends, and how far the text is known to be valid. Standard library only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass
class ScannedObject:
    """A JSON object read from ``text[start:]``: each top-level field's value span (``end`` None while the value is
    still incomplete: it runs to the end of the text), and ``end``, the index after its ``}`` (None while open)."""

    start: int
    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None
    broken: bool = False  # the text is not (a prefix of) a JSON object

    def value_text(self, text: str, key: str) -> str | None:
        """The raw text of field ``key``'s value so far (None if the key has not appeared)."""
        span = self.fields.get(key)
        if span is None:
            return None
        return text[span[0]:span[1]] if span[1] is not None else text[span[0]:]

    def complete_value(self, text: str, key: str) -> object | None:
        """Field ``key``'s decoded value once it is complete, else None."""
        span = self.fields.get(key)
        if span is None or span[1] is None:
            return None
        return json.loads(text[span[0]:span[1]])


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def scan_object(text: str, start: int) -> ScannedObject:
    """Read the JSON object at ``text[start:]`` (after leading whitespace) as far as the text goes."""
    i = skip_ws(text, start)
    out = ScannedObject(i)
    if i >= len(text):
        return out
    if text[i] != "{":
        out.broken = True
        return out
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return out
        if text[i] == "}":
            out.end = i + 1
            return out
        if text[i] == ",":
            i = skip_ws(text, i + 1)
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            out.broken = _complete_but_invalid(text, i)
            return out
        if not isinstance(key, str):
            out.broken = True
            return out
        i = skip_ws(text, i)
        if i >= len(text):
            return out
        if text[i] != ":":
            out.broken = True
            return out
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return out
        try:
            _, end = _DECODER.raw_decode(text, i)
        except ValueError:
            out.fields[key] = (i, None)
            return out
        if end == len(text) and text[i] not in '{["' and not _is_literal(text[i:end]):
            out.fields[key] = (i, None)  # a number at the end of the text may still grow
            return out
        out.fields[key] = (i, end)
        i = end


def _is_literal(value: str) -> bool:
    return value in ("true", "false", "null")


def _complete_but_invalid(text: str, i: int) -> bool:
    """Whether ``text[i:]`` can no longer become a JSON string (a key must be one)."""
    return i < len(text) and text[i] != '"'


def scan_array_of_objects(text: str, start: int) -> tuple[list[ScannedObject], int | None, bool]:
    """Read a JSON array of objects at ``text[start:]``: the objects so far (the last may be open), the index
    after its ``]`` (None while open), and whether the text is broken (not a prefix of such an array)."""
    i = skip_ws(text, start)
    objects: list[ScannedObject] = []
    if i >= len(text):
        return objects, None, False
    if text[i] != "[":
        return objects, None, True
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return objects, None, False
        if text[i] == "]":
            return objects, i + 1, False
        if objects and text[i] == ",":
            i = skip_ws(text, i + 1)
        obj = scan_object(text, i)
        objects.append(obj)
        if obj.broken:
            return objects, None, True
        if obj.end is None:
            return objects, None, False
        i = obj.end
