"""The JSON-in-tags format (Hermes, Qwen2.5/Qwen3, Granite 4.0): each call is
``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``, one or more, after any text."""

from __future__ import annotations

from hybridserve.tool_parsers.base import (
    ParsedOutput,
    TagRenderer,
    ToolCallDraft,
    ToolCallParser,
    ToolSpec,
    call_rule,
    draft_of,
    finish,
)
from hybridserve.tool_parsers.json_scan import scan_object


class HermesToolParser(ToolCallParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, pos = self.content_before(text, final)
        calls: list[ToolCallDraft] = []
        while pos is not None:
            body_start = pos + len(self.start_tag)
            close = text.find(self.end_tag, body_start)
            body = text[body_start:close] if close >= 0 else text[body_start:]
            obj = scan_object(body, 0)
            draft = draft_of(body, obj)
            draft.complete = draft.complete and (close >= 0 or final)
            calls.append(draft)
            if close < 0:
                break
            nxt = text.find(self.start_tag, close + len(self.end_tag))
            pos = nxt if nxt >= 0 else None
        return finish(content, calls, text, final)

    def grammar(self, tools: list[ToolSpec], parallel: bool, tag: TagRenderer) -> str:
        one = f'{tag(self.start_tag)} "\\n" ({call_rule(tag, tools)}) "\\n" {tag(self.end_tag)}'
        more = ' ("\\n" tool_call)*' if parallel else ""
        return f"tool_call: {one}\ntool_calls: tool_call{more}\n"
