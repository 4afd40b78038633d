"""Structured output offline: JSON schemas, regexes, choices and grammars on the shipped default model.

The schemas bound every string (``maxLength``), array (``maxItems``) and number (``minimum``/``maximum``, enums),
and JSON is compact (no free whitespace), so any output the grammar allows ends within ``MAX_TOKENS``: even
strings made entirely of ``\\uXXXX`` escapes. Every output must therefore finish with reason "stop" and
validate; none may be cut at the length limit.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.default_model import default_model_path
from hybridserve.sampling_params import StructuredOutputsParams
from hybridserve.structured_output import matcher as matcher_module
from hybridserve.structured_output.bitmask import apply_token_bitmask
from tests.checkpoints import bamba_config, build
from tests.prefix_utils import assert_drained

MAX_TOKENS = 512
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "cross"]},
        "friends": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10}, "close": {"type": "boolean"}},
            "required": ["name", "close"], "additionalProperties": False}},
        "scores": {"type": "array", "maxItems": 4, "items": {"type": "integer", "minimum": -50, "maximum": 50}},
    },
    "required": ["name", "age", "mood", "friends", "scores"],
    "additionalProperties": False,
}
NAME_REGEX = r"(Mr|Mrs|Miss) [A-Z][a-z]{2,9}, aged [1-9][0-9]?"
PROSE_REGEX = r"[a-z][a-z ,;']{29,59}\."
PROMPTS = ["Mr. Darcy said", "It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever",
           "The family of Dashwood", "Sir Walter Elliot, of Kellynch Hall"]


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_path(), cache_memory="32MiB")


def _texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def _drained(llm: LLM) -> None:
    assert llm.engine.structured.num_matchers == 0
    assert_drained(llm.engine)


def _all_stopped(outs) -> None:
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert {c.finish_reason for o in outs for c in o.outputs} == {"stop"}


def test_json_schema_outputs_validate(llm):
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=so(json=PERSON))
               for s in range(24)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so(json=json.dumps(PERSON)))
    outs = llm.generate([PROMPTS[s % len(PROMPTS)] for s in range(24)], sampled, use_tqdm=False)
    outs += llm.generate(PROMPTS, greedy, use_tqdm=False)
    _all_stopped(outs)
    docs = [json.loads(t) for t in _texts(outs)]
    for doc in docs:
        jsonschema.validate(doc, PERSON)
    assert len({json.dumps(d) for d in docs[:24]}) > 12  # the samples explore the schema, not one fixed document
    assert any(d["friends"] for d in docs) and any(d["scores"] for d in docs)
    _drained(llm)


def test_json_object_is_any_object(llm):
    outs = llm.generate(PROMPTS[:3], [SamplingParams(temperature=1.0, seed=s, max_tokens=64,
                                                     structured_outputs=so(json_object=True)) for s in range(3)],
                        use_tqdm=False)
    for o in outs:  # an unbounded grammar: completed objects parse, cut ones are still an object's prefix
        c = o.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 64
    _drained(llm)


@pytest.mark.parametrize("pattern", [NAME_REGEX, PROSE_REGEX])
def test_regex_outputs_fullmatch(llm, pattern):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=so(regex=pattern))
              for s in range(12)]
    params += [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so(regex=pattern))] * 3
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(15)], params, use_tqdm=False)
    _all_stopped(outs)
    for text in _texts(outs):
        assert re.fullmatch(pattern, text), text
    _drained(llm)


def test_choice_and_n_children_each_valid(llm):
    choices = ["yes", "no", "perhaps not", "Mr. Knightley"]
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, structured_outputs=so(choice=choices))
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    _all_stopped(outs)
    texts = _texts(outs)
    assert len(texts) == 24 and set(texts) <= set(choices) and len(set(texts)) > 1
    schema_n = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs=so(json=PERSON))
    outs = llm.generate(PROMPTS[:1], schema_n, use_tqdm=False)
    _all_stopped(outs)
    docs = _texts(outs)
    for doc in docs:
        jsonschema.validate(json.loads(doc), PERSON)
    assert len(set(docs)) > 1  # children sampled their own documents from their own matcher states
    _drained(llm)


def test_grammars_lark_and_gbnf(llm):
    lark = 'start: greeting " " name "."\ngreeting: "Dear" | "My dear"\nname: /[A-Z][a-z]{2,8}/'
    gbnf = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9] | [1-9] [0-9]'
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS,
                                                     structured_outputs=so(grammar=g))
                                      for s, g in enumerate([lark, gbnf])], use_tqdm=False)
    _all_stopped(outs)
    assert re.fullmatch(r"(Dear|My dear) [A-Z][a-z]{2,8}\.", outs[0].outputs[0].text)
    assert re.fullmatch(r"\((\d|[1-9]\d)(,(\d|[1-9]\d)){0,3}\)", outs[1].outputs[0].text)
    _drained(llm)


def test_unconstrained_neighbours_get_their_tokens_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS, structured_outputs=so(json=PERSON))
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[4], PROMPTS[2]]
    outs = llm.generate(prompts, [plain, constrained, plain, constrained, plain], use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        jsonschema.validate(json.loads(outs[i].outputs[0].text), PERSON)
    _drained(llm)


def test_preemption_keeps_greedy_constrained_outputs(llm):
    g = torch.Generator().manual_seed(11)
    tok = llm.engine.detokenizer.tokenizer
    prompts = [{"prompt_token_ids": torch.randint(3, 4096, (95,), generator=g).tolist()} for _ in range(6)]
    specs = [so(regex=PROSE_REGEX), so(json=PERSON), so(regex=NAME_REGEX)] * 2
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=s) for s in specs]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    layout = llm.cache_layout()
    per_seq = layout["slot_bytes"] + 7 * layout["page_bytes"]  # a sequence of ~110 tokens
    tight = LLM(default_model_path(), cache_memory=3 * per_seq + 64, max_num_batched_tokens=32)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    _all_stopped(outs)
    assert re.fullmatch(PROSE_REGEX, tok.decode(expected[0]))
    _drained(tight)
    _drained(llm)


def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True,
                            structured_outputs=so(choice=["Elinor", "Marianne"]))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    _all_stopped(outs)
    assert set(_texts(outs)) <= {"Elinor", "Marianne"}
    _drained(llm)


def test_stop_token_ids_end_an_accepting_grammar(llm):
    stop = 2  # <|im_end|>: no letter, so the regex never emits it; pushed up so it wins once it is allowed
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], logit_bias={stop: 100.0},
                            structured_outputs=so(regex=r"[a-z]{1,40}"))
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids[-1] == stop and re.fullmatch(r"[a-z]{1,40}", llm.engine.detokenizer.decode(out.token_ids[:-1]))
    assert len(out.token_ids) == 2  # the first token already satisfies the regex, then the stop token wins
    _drained(llm)


@pytest.mark.parametrize("spec, field, problem", [
    (dict(regex="[a-"), "structured_outputs.regex", "unclosed character class"),
    (dict(json={"type": "objec"}), "structured_outputs.json", "objec"),
    (dict(json={"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}),
     "structured_outputs.json", "unclosed group"),
    (dict(grammar="start: foo"), "structured_outputs.grammar", "foo"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
])
def test_bad_grammars_raise_at_add(llm, spec, field, problem):
    params = SamplingParams(max_tokens=8, structured_outputs=so(**spec))
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        llm.generate(["Mr. Darcy", "Emma"], [SamplingParams(max_tokens=4), params], use_tqdm=False)
    assert problem in str(info.value) and "prompt 1" in str(info.value)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued, not even the good prompt
    _drained(llm)


@pytest.mark.parametrize("kw, message", [
    ({}, "got none"), (dict(regex="a", choice=["b"]), "got regex, choice"), (dict(json="{"), "not valid JSON"),
    (dict(json=[1]), "JSON schema object"), (dict(choice=[]), "non-empty list"), (dict(grammar=""), "non-empty"),
])
def test_params_need_exactly_one_valid_field(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_abort_releases_matchers(llm):
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=MAX_TOKENS, structured_outputs=so(json=PERSON), n=3)
    engine.add_request("abort-me", llm.engine.detokenizer.tokenizer.encode("Mr. Darcy"), params)
    for _ in range(3):
        engine.step()
    assert engine.structured.num_matchers == 3
    engine.abort_request("abort-me")
    _drained(llm)


def test_a_refused_token_fails_only_its_request(llm, monkeypatch):
    monkeypatch.setattr(matcher_module, "apply_token_bitmask", lambda *a, **k: None)  # the mask is lost
    ids = llm.engine.detokenizer.tokenizer.encode(PROMPTS[0])
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": ids}], plain, use_tqdm=False)[0].outputs[0].token_ids
    digits = SamplingParams(temperature=0, max_tokens=12, structured_outputs=so(regex="[0-9]{12}"))
    outs = llm.generate([{"prompt_token_ids": ids}] * 2, [digits, plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "the grammar does not allow token" in outs[0].error
    assert outs[1].error is None and outs[1].outputs[0].token_ids == alone
    _drained(llm)


@pytest.mark.parametrize("vocab", [4096 + 61, 4000])
def test_logits_and_tokenizer_of_different_widths(tmp_path, vocab):
    """A random model whose logits have 61 more entries than its tokenizer (the mask excludes them), or 96
    fewer (the bitmasks are cut to the logits)."""
    import shutil

    path = str(tmp_path / "wide")
    build(bamba_config(vocab_size=vocab), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model_path()}/{name}", path)
    wide = LLM(path, cache_memory="16MiB")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=so(json=PERSON))
              for s in range(6)]
    outs = wide.generate(["Mr. Darcy said"] * 6, params, use_tqdm=False)
    _all_stopped(outs)
    for o in outs:
        assert max(o.outputs[0].token_ids) < min(vocab, 4096)
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    _drained(wide)


@pytest.mark.parametrize("vocab", [4096, 4100, 4127, 200])
def test_apply_token_bitmask_matches_bit_by_bit(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 - (1 if vocab == 200 else 0)  # 200: the bitmask covers only 192 tokens
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, words), generator=g, dtype=torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows=[4, 0, 2])
    words_list, got_list, logits_list = bitmask.tolist(), got.tolist(), logits.tolist()
    for r, row in enumerate([4, 0, 2]):
        for t in range(vocab):
            allowed = t < 32 * words and (words_list[r][t // 32] >> (t % 32)) & 1
            assert got_list[row][t] == (logits_list[row][t] if allowed else float("-inf"))
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
