"""The thinking-tag reasoning parser: where the output starts (from the prompt), the split, and streaming."""

from __future__ import annotations

import pytest

from hybridserve.reasoning import reasoning_parser


@pytest.fixture
def parser():
    return reasoning_parser("think")


def test_prompt_state(parser):
    assert parser.prompt_state("<|im_start|>assistant\n<think>\n") == "inside"
    assert parser.prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "after"
    assert parser.prompt_state("<|im_start|>assistant\n") == "before"


@pytest.mark.parametrize("state,text,reasoning,content", [
    ("before", "<think>Two plus two.</think>\n\nFour.", "Two plus two.", "Four."),
    ("before", "\n<think>a</think>b", "a", "b"),
    ("before", "No reasoning here.", "", "No reasoning here."),
    ("inside", "Two plus two.</think>Four.", "Two plus two.", "Four."),
    ("inside", "never ends", "never ends", ""),
    ("after", "<think>a</think>b", "", "<think>a</think>b"),
])
def test_split_final(parser, state, text, reasoning, content):
    split = parser.split(text, state, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_streaming_prefixes_never_show_a_partial_tag(parser):
    text = "<think>Two plus two.</think>Four."
    for cut in range(len(text) + 1):
        split = parser.split(text[:cut], "before", final=False)
        assert "Two plus two.".startswith(split.reasoning), cut
        assert "<" not in split.reasoning and "Four.".startswith(split.content), cut
        assert split.ended == (cut >= text.index("Four")), cut


def test_unknown_parser_names_the_flag():
    with pytest.raises(ValueError, match="--reasoning-parser='nope'"):
        reasoning_parser("nope")
