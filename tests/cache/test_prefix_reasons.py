"""Every request is told why its prompt did or did not resume from the prefix cache (``cache/prefix_reason.py``),
and every lookup is counted by reason; ``salted`` is counted but never told."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.cache.evicted_prefixes import EvictedPrefixes
from hybridserve.cache.prefix_reason import PrefixCacheReason as R
from tests.checkpoints import make

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make(str(tmp_path_factory.mktemp("ckpt")), "bamba")  # Mamba2 state and attention, 16-token pages


@pytest.fixture
def llm(path):
    return LLM(path, cache_memory="8MiB", enable_progress_bar=False, max_num_seqs=4)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 120) for _ in range(n)]


def _answer(llm, prompt, params=PARAMS, salt=None):
    request = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
    out = llm.generate([request], params)[0]
    assert out.prefix_cache is not None and out.prefix_cache.cached_tokens == out.num_cached_tokens
    return out.prefix_cache


def _lookups(llm) -> dict[str, int]:
    stats = llm.engine.prefix_cache_stats()
    return {r.value: stats[f"lookups:{r.value}"] for r in R if stats[f"lookups:{r.value}"]}


def test_no_match_then_hit(llm):
    first = _prompt(40, 1)
    assert _answer(llm, first).reason is R.NO_MATCH
    again = _answer(llm, first + _prompt(9, 2))  # resumes from the snapshot at the first prompt's end
    assert again.reason is R.HIT and again.cached_tokens == 40 and again.snapshot_tokens == 40
    assert _lookups(llm) == {"no_match": 1, "hit": 1}
    stats = llm.engine.prefix_cache_stats()
    assert stats["queries:no_match"] == 40 and stats["queries:hit"] == 49


def test_no_snapshot_says_how_far_it_matched(llm):
    first = _prompt(40, 3)
    _answer(llm, first)
    diverging = first[:30] + _prompt(12, 4)  # KV matches 30 tokens; the only snapshot is at 40
    info = _answer(llm, diverging)
    assert info.reason is R.NO_SNAPSHOT and info.cached_tokens == 0
    assert info.matched_tokens == 30 and info.snapshot_tokens is None and info.snapshot_past_tokens == 40
    # its prefill stopped at the divergence point to snapshot there: the next such prompt hits
    assert _answer(llm, first[:30] + _prompt(12, 5)).reason is R.HIT
    other = _prompt(40, 13)
    _answer(llm, other)
    same = _answer(llm, other)  # the same prompt: its last token is always computed, the snapshot is past it
    assert (same.reason, same.matched_tokens, same.snapshot_past_tokens) == (R.NO_SNAPSHOT, 39, 40)


def test_too_short_and_prompt_logprobs(llm):
    assert _answer(llm, _prompt(10, 6)).reason is R.TOO_SHORT  # less than one 16-token page to reuse
    logprobs = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = _prompt(40, 7)
    _answer(llm, first)
    assert _answer(llm, first + [5, 6], logprobs).reason is R.PROMPT_LOGPROBS


def test_evicted_is_told_apart_from_never_cached(llm):
    first = _prompt(40, 8)
    _answer(llm, first)
    assert llm.engine.reset_prefix_cache()  # evicts every page and snapshot
    assert _answer(llm, first + _prompt(5, 9)).reason is R.EVICTED
    assert _answer(llm, _prompt(45, 10)).reason is R.NO_MATCH  # never cached


def test_salted_is_counted_but_never_told(llm):
    first = _prompt(40, 11)
    _answer(llm, first, salt="tenant-a")
    index = llm.engine.cache.prefix.index
    tenant_a = [item for item in index.items() if (item.salt if hasattr(item, "salt") else item.node.salt)]
    before = [(item.hits, item.last_used, item.version, item.removed) for item in tenant_a]
    assert tenant_a
    other = _answer(llm, first + [7, 8], salt="tenant-b")
    assert other.reason is R.NO_MATCH and other.cached_tokens == 0 and other.matched_tokens == 0  # told: nothing
    assert _lookups(llm)["salted"] == 1  # counted
    after = [(item.hits, item.last_used, item.version, item.removed) for item in tenant_a]
    assert after == before  # tenant a's entries untouched: no hit, no recency, no eviction order change
    unsalted = _answer(llm, first + [9, 10])
    assert unsalted.reason is R.NO_MATCH and _lookups(llm)["salted"] == 2  # the unsalted tree is another salt


def test_caching_off(path):
    llm = LLM(path, cache_memory="8MiB", enable_progress_bar=False, max_num_seqs=4, enable_prefix_caching=False)
    info = _answer(llm, _prompt(40, 12))
    assert info.reason is R.CACHING_OFF and info.cached_tokens == 0
    assert _lookups(llm) == {"caching_off": 1}


def test_the_evicted_record_is_bounded():
    record = EvictedPrefixes(capacity=3)
    for key in range(5):
        record.add(key)
    record.add(9, (1, 2))
    assert len(record) == 3 and not record.has_page(0) and record.has_page(4)
    assert record.has_snapshot(9, [7] * 16 + [1, 2, 3], 16, 30, 16)
    assert not record.has_snapshot(9, [7] * 16 + [1, 3], 16, 30, 16)  # another tail
    assert not record.has_snapshot(9, [7] * 16 + [1, 2, 3], 16, 17, 16)  # past the limit
