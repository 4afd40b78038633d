"""The tool-call parsers (hermes, granite): whole texts, texts cut anywhere (the streaming view), and what is not
a valid call staying content."""

from __future__ import annotations

import json

import pytest

from hybridserve.tool_parsers import tool_parser

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
          '\n<tool_call>\n{"name": "add", "arguments": {"a": [1, 2.5e3], "b": {"c": "x}y"}}}\n</tool_call>')
GRANITE = ('Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
           '{"name": "add", "arguments": {"a": [1, 2.5e3], "b": {"c": "x}y"}}}]')
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": [1, 2500.0], "b": {"c": "x}y"}})]


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("granite", GRANITE)])
def test_whole_text_gives_content_and_calls(name, text):
    parsed = tool_parser(name).parse(text, final=True)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == EXPECTED
    assert all(c.complete for c in parsed.calls)


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("granite", GRANITE)])
def test_every_prefix_grows_toward_the_final_parse(name, text):
    """Cut anywhere, content and each call's arguments are prefixes of the final ones, a name appears only
    whole, and a tail that may open a call is never shown as content."""
    parser = tool_parser(name)
    final = parser.parse(text, final=True)
    for cut in range(len(text) + 1):
        part = parser.parse(text[:cut], final=False)
        assert final.content.startswith(part.content), cut
        for got, want in zip(part.calls, final.calls):
            assert got.name in (None, want.name), cut
            assert want.arguments.startswith(got.arguments), cut


@pytest.mark.parametrize("name", ["hermes", "granite"])
def test_text_without_calls_is_content(name):
    parsed = tool_parser(name).parse("Just an answer, <tool no call.", final=True)
    assert parsed.content == "Just an answer, <tool no call." and parsed.calls == []


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>'),  # arguments cut
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # arguments not an object
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}'),  # array never closed
    ("granite", '<|tool_call|>{"name": "f"}'),  # not an array
])
def test_a_malformed_call_leaves_the_whole_text_as_content(name, text):
    parsed = tool_parser(name).parse(text, final=True)
    assert parsed.calls == [] and parsed.content == text


def test_hermes_holds_back_a_partial_tag_while_streaming():
    parser = tool_parser("hermes")
    assert parser.parse("Sure <tool_c", final=False).content == "Sure "
    assert parser.parse("Sure <tool_c", final=True).content == "Sure <tool_c"


def test_unknown_parser_names_the_flag_and_choices():
    with pytest.raises(ValueError, match=r"--tool-call-parser='x'.*granite, hermes"):
        tool_parser("x")
