"""Reasoning parsers (``--reasoning-parser``): split a thinking model's output into reasoning and reply."""

from __future__ import annotations

from hybridserve.options import named_entry
from hybridserve.reasoning.think_tags import ReasoningSplit, ThinkTagReasoningParser

#: ``--reasoning-parser`` name -> parser class (``qwen3`` and ``deepseek_r1``: vLLM's names for the same format)
REASONING_PARSERS = {"think": ThinkTagReasoningParser, "qwen3": ThinkTagReasoningParser,
                     "deepseek_r1": ThinkTagReasoningParser}

__all__ = ["REASONING_PARSERS", "ReasoningSplit", "ThinkTagReasoningParser", "reasoning_parser"]


def reasoning_parser(name: str) -> ThinkTagReasoningParser:
    """The parser called ``name``; ValueError listing the names and the flag otherwise."""
    return named_entry("--reasoning-parser", name, REASONING_PARSERS)()
