"""Tool-call parsers, one module per model family's format, chosen by ``--tool-call-parser``."""

from __future__ import annotations

from hybridserve.tool_parsers.base import ParsedOutput, TagRenderer, ToolCallDraft, ToolCallParser, ToolSpec
from hybridserve.tool_parsers.granite import GraniteToolParser
from hybridserve.tool_parsers.hermes import HermesToolParser

#: ``--tool-call-parser`` name -> parser class
TOOL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesToolParser, "granite": GraniteToolParser}

__all__ = ["TOOL_PARSERS", "ParsedOutput", "TagRenderer", "ToolCallDraft", "ToolCallParser", "ToolSpec",
           "tool_parser"]


def tool_parser(name: str) -> ToolCallParser:
    """The parser called ``name``; ValueError listing the names and the flag otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"--tool-call-parser={name!r} is not a known parser: choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return cls()
