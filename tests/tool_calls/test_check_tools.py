"""Tools are never silently ignored: without a tool-call parser, or with a chat template that does not render
them, a request with tools is a 400 naming the flag or the template (chat_tools.check_tools)."""

from __future__ import annotations

import pytest

from hybridserve.entrypoints.openai.chat_tools import check_tools
from hybridserve.entrypoints.openai.errors import APIError
from hybridserve.entrypoints.openai.protocol import ChatCompletionRequest
from hybridserve.tool_parsers import tool_parser

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize("parser,takes_tools,problem", [
    (None, True, "--tool-call-parser"),
    ("hermes", False, "does not render tools"),
])
def test_tools_that_cannot_be_used_are_400_naming_why(parser, takes_tools, problem):
    with pytest.raises(APIError) as info:
        check_tools(_request(tools=[TOOL]), tool_parser(parser) if parser else None, takes_tools)
    assert info.value.status == 400 and info.value.param == "tools" and problem in info.value.message


def test_tool_choice_none_needs_neither_parser_nor_template():
    assert check_tools(_request(tools=[TOOL], tool_choice="none"), None, False) == []


def test_usable_tools_come_back_as_specs():
    specs = check_tools(_request(tools=[TOOL], tool_choice="required"), tool_parser("hermes"), True)
    assert [(s.name, s.parameters) for s in specs] == [("f", {"type": "object"})]
