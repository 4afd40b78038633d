"""Tool-call parsers, one module per model family's format, chosen by ``--tool-call-parser``."""

from __future__ import annotations

from hybridserve.options import named_entry
from hybridserve.tool_parsers.base import ParsedOutput, TagRenderer, ToolCallDraft, ToolCallParser, ToolSpec
from hybridserve.tool_parsers.granite import GraniteToolParser
from hybridserve.tool_parsers.hermes import HermesToolParser

#: ``--tool-call-parser`` name -> parser class
TOOL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesToolParser, "granite": GraniteToolParser}

__all__ = ["TOOL_PARSERS", "ParsedOutput", "TagRenderer", "ToolCallDraft", "ToolCallParser", "ToolSpec",
           "tool_parser"]


def tool_parser(name: str) -> ToolCallParser:
    """The parser called ``name``; ValueError listing the names and the flag otherwise."""
    return named_entry("--tool-call-parser", name, TOOL_PARSERS)()
