"""Structured output's grammar limits offline (docs/structured_output.md, "Limits"): the constraint's size, the
compile time, grammars over llguidance's parser limits refused at add time, one compilation per grammar, and the
compiled-grammar cache bounded in bytes (least recently used dropped). The shipped default model."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.default_model import default_model_path
from hybridserve.sampling_params import StructuredOutputsParams
from hybridserve.structured_output.grammar_cache import GrammarCache
from tests.prefix_utils import assert_drained

CACHE_BYTES = 512 * 2 ** 10  # each entry is estimated at >= 16 KiB + 32 bytes a grammar character
#: grammars within the limits of their size, over llguidance's parser limits (the issue's reports, scaled down
#: where that keeps them over the limit): the message part that names the limit
OVER_PARSER_LIMITS = [
    (dict(regex="a{1000000}"), "too many expressions"),
    (dict(regex="(a{1000}){1000}"), "too many expressions"),
    (dict(json={"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                     "required": ["x"]}}}), "limit 50000"),
    (dict(json={"anyOf": [{"const": [i]} for i in range(3000)]}), "max is 2000"),
]


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_path(), cache_memory="32MiB", grammar_cache_bytes=CACHE_BYTES)


def _constrained(**spec) -> SamplingParams:
    return SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(**spec))


def test_compiled_grammar_cache_stays_within_its_bytes(llm):
    compiler = llm.engine.structured.compiler
    regexes = [f"[a-z]{{1,{k}}}(x|y|z){{2}}[0-9]{{0,{k % 5}}}" for k in range(2, 42)]
    for regex in regexes:
        llm.generate("Hello", _constrained(regex=regex), use_tqdm=False)
        assert compiler.cache.bytes <= CACHE_BYTES
    assert 1 <= len(compiler.cache) < len(regexes)  # the bound dropped some (40 entries of >= 16 KiB each)
    newest = StructuredOutputsParams(regex=regexes[-1]).key()
    assert compiler.cache.get(newest) is not None  # the most recently used is kept
    assert_drained(llm.engine)


def test_each_grammar_compiles_once(llm):
    compiler = llm.engine.structured.compiler
    before = compiler.num_compiles
    params = _constrained(regex="(ab|cd){1,3}q")
    outs = llm.generate(["Mr. Darcy", "Emma"], [params, params], use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert compiler.num_compiles == before + 1  # two requests, their matchers: one compilation
    llm.generate("Hello", _constrained(regex="(ab|cd){1,3}q"), use_tqdm=False)  # equal params: the cached one
    assert compiler.num_compiles == before + 1


@pytest.mark.parametrize("spec, limit", OVER_PARSER_LIMITS)
def test_grammars_over_parser_limits_raise_at_add(llm, spec, limit):
    with pytest.raises(ValueError, match="over the grammar engine's limits") as info:
        llm.generate(["Mr. Darcy", "Emma"], [SamplingParams(max_tokens=2), _constrained(**spec)], use_tqdm=False)
    assert limit in str(info.value) and "prompt 1" in str(info.value)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued, not even the good prompt
    assert_drained(llm.engine)


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident memory from /proc")
def test_refused_grammars_are_freed(llm):
    """A grammar refused at its probe (~80 MiB of lexer state each) is freed at once, not kept alive by the
    exception's frames until the garbage collector runs."""
    before = _resident_mib()
    for letter in "bcde":
        with pytest.raises(ValueError, match="over the grammar engine's limits"):
            llm.generate("Hello", _constrained(regex=f"{letter}{{1000000}}"), use_tqdm=False)
    assert _resident_mib() - before < 200  # about 100 MiB (the allocator keeps freed pages); 350 when held


def test_grammar_over_max_bytes_is_refused_naming_the_flag(llm):
    with pytest.raises(ValueError, match=re.escape("over the limit of 65536 bytes")) as info:
        llm.generate("Hello", _constrained(choice=[f"choice number {i}" for i in range(5000)]), use_tqdm=False)
    assert "--max-grammar-bytes" in str(info.value) and "structured_outputs.choice" in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_slow_compile_is_refused_naming_the_flag():
    llm = LLM(default_model_path(), cache_memory="32MiB", max_grammar_compile_seconds=0.05,
              max_grammar_bytes=2 ** 20)
    choices = [f"c{i}x" for i in range(20000)]  # about 0.5 s to compile (and then over llguidance's row limit)
    with pytest.raises(ValueError, match=re.escape("did not compile within the limit of 0.05 s")) as info:
        llm.generate("Hello", _constrained(choice=choices), use_tqdm=False)
    assert "--max-grammar-compile-seconds" in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)  # no grammar: no wait for the worker
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 2
    llm.engine.shutdown()


@pytest.mark.parametrize("options, message", [
    (dict(max_grammar_bytes=0), "max_grammar_bytes=0"),
    (dict(max_grammar_compile_seconds=0), "max_grammar_compile_seconds=0"),
    (dict(grammar_cache_bytes="lots"), "grammar_cache_bytes='lots'"),
])
def test_bad_limits_are_refused_naming_the_option(options, message):
    from hybridserve.config import EngineConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(model="x", **options)


@dataclass
class _Entry:
    size_bytes: int


def test_grammar_cache_evicts_least_recently_used_and_skips_oversized():
    cache = GrammarCache(max_bytes=100)
    for key in "abc":
        assert cache.put(key, _Entry(30))
    cache.get("a")  # now the most recently used: b goes first
    assert cache.put("d", _Entry(30))
    assert [k for k in "abcd" if cache.get(k) is not None] == ["a", "c", "d"] and cache.bytes == 90
    assert not cache.put("huge", _Entry(101))  # larger than the whole budget: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 3 and cache.bytes == 90
    assert cache.put("e", _Entry(100))
    assert len(cache) == 1 and cache.bytes == 100
