"""Streamed replies (chat_stream.ReplyStream): reasoning, content and tool-call deltas, for text arriving in
pieces of any size, add up to the reply read whole; a call's id and name come first, alone."""

from __future__ import annotations

import random

import pytest

from hybridserve.entrypoints.openai.chat_stream import ReplyStream
from hybridserve.entrypoints.openai.chat_tools import ReplyReader
from hybridserve.reasoning import reasoning_parser
from hybridserve.tool_parsers import tool_parser

TEXT = ('<think>Need the weather.</think>\n\nChecking.<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 12}}\n</tool_call>')


@pytest.mark.parametrize("seed", range(5))
def test_deltas_add_up_to_the_whole_reply(seed):
    reader = ReplyReader(tool_parser("hermes"), reasoning_parser("think"), "before")
    whole = reader.read(TEXT, final=True)
    stream = ReplyStream(reader)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 12)) + [len(TEXT)]
    reasoning = content = ""
    calls: dict[int, dict] = {}
    start = 0
    for end in cuts:
        delta = stream.advance(TEXT[start:end], final=end == len(TEXT))
        start = end
        reasoning += delta.reasoning
        content += delta.content
        for piece in delta.tool_calls:
            if piece.id is not None:
                assert piece.index not in calls and piece.function.name and piece.function.arguments == ""
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:
                calls[piece.index]["arguments"] += piece.function.arguments
    assert reasoning == whole.reasoning == "Need the weather."
    assert content == whole.content == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole.calls]
    assert stream.called


def test_plain_text_streams_unchanged():
    stream = ReplyStream(ReplyReader())
    assert [stream.advance(p, final=False).content for p in ("Hel", "lo <", "tool")] == ["Hel", "lo <", "tool"]
    assert not stream.called
