"""The grammars of forced tool calls (``tool_choice`` required or named) and of structured output after
reasoning: walked token by token through llguidance with random allowed tokens, every output parses as calls of
the allowed tools whose arguments satisfy their schemas, and reasoning text is free until its end tag."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from hybridserve.reasoning import reasoning_parser
from hybridserve.structured_output.compiler import GrammarCompiler
from hybridserve.structured_output.params import StructuredOutputsParams
from hybridserve.structured_output.tool_grammar import reply_grammar
from hybridserve.tool_parsers import TagRenderer, ToolSpec, tool_parser
from tests.server.tool_checkpoint import HERMES_TEMPLATE, tool_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [ToolSpec("get_weather", WEATHER), ToolSpec("add", ADD)]
SCHEMAS = {t.name: t.parameters for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizer():
    return tool_tokenizer(HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    yield c
    c.close()


def walk(compiler, tokenizer, grammar: str, seed: int, forced_prefix: str = "", max_tokens: int = 300) -> str:
    """Text of a random walk through the grammar: ``forced_prefix``'s tokens first, then random allowed tokens."""
    matcher = compiler.compile(StructuredOutputsParams(grammar=grammar)).new_matcher()
    rng = random.Random(seed)
    ids = tokenizer.encode(forced_prefix, add_special_tokens=False) if forced_prefix else []
    for t in ids:
        assert matcher.consume_token(t), (forced_prefix, matcher.get_error())
    words = torch.zeros((len(tokenizer) + 31) // 32, dtype=torch.int32)
    for _ in range(max_tokens):
        if matcher.is_stopped():
            break
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        bits = int.from_bytes(words.numpy().tobytes(), "little")
        allowed = [t for t in range(len(tokenizer)) if bits >> t & 1]
        # lean toward EOS / closing so the walk ends (any allowed token is valid)
        eos = tokenizer.eos_token_id
        t = eos if eos in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.consume_token(t)
        if t == tokenizer.eos_token_id:
            break
        ids.append(t)
    assert matcher.is_stopped() or matcher.is_accepting(), "the walk did not end within max_tokens"
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("parser_name", ["hermes", "granite"])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_always_parse_and_match_their_schemas(compiler, tokenizer, parser_name, parallel):
    parser = tool_parser(parser_name)
    tag = TagRenderer(tokenizer.get_added_vocab())
    grammar = reply_grammar("tool_calls", parser.grammar(TOOLS, parallel, tag), None)
    for seed in range(6):
        text = walk(compiler, tokenizer, grammar, seed)
        parsed = parser.parse(text, final=True)
        assert parsed.calls and parsed.content == "", text
        assert parallel or len(parsed.calls) == 1
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_named_choice_allows_only_that_tool(compiler, tokenizer):
    parser = tool_parser("hermes")
    grammar = reply_grammar("tool_calls", parser.grammar([TOOLS[1]], False, TagRenderer(tokenizer.get_added_vocab())),
                            None)
    for seed in range(4):
        calls = parser.parse(walk(compiler, tokenizer, grammar, seed), final=True).calls
        assert [c.name for c in calls] == ["add"]


@pytest.mark.parametrize("added_tags", [True, False])
def test_the_constraint_starts_after_the_reasoning(compiler, tokenizer, added_tags):
    """Free text (even text the constraint would refuse) is accepted before </think>; after it, only calls."""
    reasoning = reasoning_parser("think")
    tag = TagRenderer(tokenizer.get_added_vocab())
    if not added_tags:
        reasoning = type(reasoning)("<reason>", "</reason>")  # tags that are plain text to this tokenizer
    parser = tool_parser("hermes")
    grammar = reply_grammar("tool_calls", parser.grammar(TOOLS, False, tag), reasoning.grammar_prefix("inside", tag))
    thought = "not json at all {{ </thin" + reasoning.end_tag + "\n"
    text = walk(compiler, tokenizer, grammar, 0, forced_prefix=thought)
    split = reasoning.split(thought[:-1] + text, "inside", final=True)
    assert split.reasoning == "not json at all {{ </thin"
    calls = parser.parse(split.content, final=True).calls
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def test_the_constraint_refuses_a_reply_before_the_reasoning_ends(compiler, tokenizer):
    reasoning = reasoning_parser("think")
    tag = TagRenderer(tokenizer.get_added_vocab())
    grammar = reply_grammar("reply", 'reply: %json{"type": "integer"}\n', reasoning.grammar_prefix("before", tag))
    matcher = compiler.compile(StructuredOutputsParams(grammar=grammar)).new_matcher()
    for t in tokenizer.encode("hello", add_special_tokens=False):  # no <think>: the reply must be an integer now
        if not matcher.consume_token(t):
            break
    else:
        pytest.fail("text outside reasoning was accepted where an integer was required")
