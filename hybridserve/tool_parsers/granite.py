"""Granite's format (Granite 3.x): ``<|tool_call|>[{"name": "f", "arguments": {...}}, ...]`` after any text:
one tag, then a JSON array of calls."""

from __future__ import annotations

from hybridserve.tool_parsers.base import (
    ParsedOutput,
    TagRenderer,
    ToolCallParser,
    ToolSpec,
    call_rule,
    draft_of,
    finish,
)
from hybridserve.tool_parsers.json_scan import scan_array_of_objects


class GraniteToolParser(ToolCallParser):
    name = "granite"
    start_tag = "<|tool_call|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, pos = self.content_before(text, final)
        if pos is None:
            return finish(content, [], text, final)
        body = text[pos + len(self.start_tag):]
        objects, end, broken = scan_array_of_objects(body, 0)
        calls = [draft_of(body, obj) for obj in objects]
        if broken or (final and end is None):
            for c in calls:
                c.complete = False  # a final output that did not close its array: not a valid call list
        return finish(content, calls, text, final)

    def grammar(self, tools: list[ToolSpec], parallel: bool, tag: TagRenderer) -> str:
        more = ' (", " tool_call)*' if parallel else ""
        return (f"tool_call: {call_rule(tag, tools)}\n"
                f'tool_calls: {tag(self.start_tag)} "[" tool_call{more} "]"\n')
