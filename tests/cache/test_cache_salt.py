"""Cache salts (vLLM's ``cache_salt``): requests with different salts never share a cached page or a state
snapshot, requests with the same salt share as unsalted ones do, and the hit length says nothing across salts."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.cache.kv_events import BlockStored
from hybridserve.cache.salt import MAX_CACHE_SALT_CHARS
from tests.checkpoints import make
from tests.prefix_utils import assert_drained, check_cache_invariants

PARAMS = dict(temperature=0, max_tokens=2, ignore_eos=True)


def _llm(ckpt_dir, family: str) -> LLM:
    return LLM(make(ckpt_dir, family), cache_memory="8MiB", enable_progress_bar=False, max_num_batched_tokens=64)


def _run(llm: LLM, prompt: list[int], salt: str | None) -> int:
    """Tokens the request resumed from the cache."""
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**PARAMS, cache_salt=salt))[0]
    return out.num_cached_tokens


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 120) for _ in range(n)]


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_salts_never_share_and_one_salt_shares_as_before(ckpt_dir, family):
    llm = _llm(ckpt_dir, family)
    prefix = _prompt(40)
    prompts = [prefix + _prompt(5, seed=i + 1) for i in range(3)]
    hits_a = [_run(llm, p, "tenant-a") for p in prompts]
    assert hits_a[0] == 0 and hits_a[2] >= 40  # the second request's branch point serves the third
    prefix_cache = llm.engine.cache.prefix
    pages_a = prefix_cache.num_cached_pages
    # another salt finds nothing of tenant a's, and then shares within itself exactly as tenant a did
    assert [_run(llm, p, "tenant-b") for p in prompts] == hits_a
    # no salt finds nothing of either, and shares among the unsalted as before
    assert [_run(llm, p, None) for p in prompts] == hits_a
    # nothing is shared: each tree holds pages of its own
    index = prefix_cache.index
    assert index.num_salts == 2
    owned = [{node.page for node in _nodes(index.root_of(salt))} for salt in ("tenant-a", "tenant-b", None)]
    assert all(len(pages) == len(owned[0]) > 0 for pages in owned)
    assert not (owned[0] & owned[1] or owned[0] & owned[2] or owned[1] & owned[2])
    assert prefix_cache.num_cached_pages == 3 * pages_a
    check_cache_invariants(llm.engine)
    assert_drained(llm.engine)
    assert llm.engine.cache.prefix.index.num_salts == 0  # a salt's emptied tree is forgotten


def _nodes(root):
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_a_tenant_sees_no_hit_from_another_salts_prompts(ckpt_dir, family):
    """Finding 1 of issue 33 (the cached_tokens oracle): an attacker sends each guess of a secret twice; the hits
    grow with the guess's match with the victim's prompt (the first send's for attention only, the second's for
    a hybrid, whose first send plants a snapshot at the branch point). Under one salt (the control) the
    right guess stands out; under another salt, or none, the attacker sees exactly the hits it sees when there
    is no victim at all (its guesses share a prefix with each other, and only that shows)."""
    prefix = _prompt(40, seed=7)
    secret = 57

    def probe(victim_salt, attacker_salt, victim: bool = True) -> list[tuple[int, int]]:
        llm = _llm(ckpt_dir, family)
        if victim:
            _run(llm, prefix + [secret, 9, 9, 9, 9, 9, 9, 9, 9, 9], victim_salt)
        hits = []
        for guess in range(50, 62):
            guess_prompt = prefix + [guess, 11, 12]
            hits.append((_run(llm, guess_prompt, attacker_salt), _run(llm, guess_prompt, attacker_salt)))
        return hits

    control = probe("same", "same")
    right = control.pop(secret - 50)
    assert right not in control  # the attack works here: the secret gets hits no wrong guess gets
    for victim_salt, attacker_salt in [("victim", "attacker"), ("victim", None), (None, "attacker")]:
        assert probe(victim_salt, attacker_salt) == probe(victim_salt, attacker_salt, victim=False)


def test_the_offline_api_takes_a_salt_on_the_prompt(ckpt_dir):
    llm = _llm(ckpt_dir, "llama")
    prompt = _prompt(30, seed=3)
    greedy = SamplingParams(**PARAMS)
    outs = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}] * 2, greedy)
    assert outs[0].num_cached_tokens == 0
    assert llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], greedy)[0].num_cached_tokens > 0
    assert llm.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}], greedy)[0].num_cached_tokens == 0
    assert greedy.cache_salt is None  # the caller's params are not changed
    with pytest.raises(ValueError, match="differs"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], SamplingParams(**PARAMS, cache_salt="b"))
    assert_drained(llm.engine)


@pytest.mark.parametrize("salt, error", [("", "must not be empty"), (5, "must be a string, not int"),
                                         ("x" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS}")])
def test_bad_salts_are_refused(salt, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(cache_salt=salt)


def test_salted_blocks_are_not_recorded_as_events(ckpt_dir):
    llm = _llm(ckpt_dir, "llama")
    events = llm.engine.cache.prefix.enable_events()
    prompt = _prompt(40, seed=5)
    _run(llm, prompt, "secret-tenant")
    salted = events.take()
    _run(llm, prompt, None)
    unsalted = events.take()
    assert salted == []
    stored = [e for e in unsalted if isinstance(e, BlockStored)]
    assert stored and list(stored[0].token_ids) == prompt[:len(stored[0].token_ids)]
    assert_drained(llm.engine)


def test_requests_queued_together_plan_branch_points_for_their_own_salt_only():
    """A leader snapshots where queued prompts leave its own, and a follower waits for that snapshot: only
    between requests of one salt (else a later hit of the leader's tenant would end where another tenant's
    prompt diverged)."""
    from types import SimpleNamespace

    from hybridserve.cache.prefix_sharing import follower_branch_points, waits_for_leader

    def seq(tokens, salt, plan=()):
        return SimpleNamespace(prompt_token_ids=tokens, num_computed_tokens=0, snapshot_plan=list(plan),
                               params=SimpleNamespace(prompt_logprobs=None, cache_salt=salt))

    base = list(range(3, 43))  # 40 shared tokens
    leader = seq(base + [1, 2], "a", plan=[40, 42])
    same, other, unsalted = seq(base + [5], "a"), seq(base + [6], "b"), seq(base + [7], None)
    assert follower_branch_points(leader, [same], start=0) == [40]
    assert follower_branch_points(leader, [other, unsalted], start=0) == []
    assert waits_for_leader(same, [leader])
    assert not waits_for_leader(other, [leader]) and not waits_for_leader(unsalted, [leader])
