"""Prefix caching: shared KV pages and state snapshots give the outputs of running every prompt in full."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve import LLM, SamplingParams
from hybridserve.cache.prefix_index import PrefixIndex
from tests.checkpoints import make
from tests.prefix_utils import assert_drained, check_cache_invariants

# every state kind, and attention only: family -> what its recurrent layers are
STATE_KINDS = {
    "bamba": "Mamba2 + attention",
    "mamba2": "Mamba2 only",
    "mamba": "Mamba1 only",
    "jamba": "Mamba1 + attention",
    "qwen3_next": "gated delta net + attention",
    "minimax": "linear attention + attention",
    "lfm2": "short conv + attention",
    "kimi_linear": "Kimi delta attention + MLA latent pages",
    "llama": "attention only",
}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
#: float32 rounding of a prefill split at another token: far below any logprob gap that matters
LOGPROB_NOISE = 1e-4


def _engines(path, **kw):
    opts = {"cache_memory": "8MiB", "enable_progress_bar": False, "max_num_batched_tokens": 64, **kw}
    return LLM(path, enable_prefix_caching=False, **opts), LLM(path, **opts)


def _prompts(shared: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 120) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 120) for _ in range(rng.randrange(1, 20))] for _ in range(count)]


def _assert_same(got, want) -> None:
    for a, b in zip(got, want):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        for ea, eb in zip(ca.logprobs, cb.logprobs):
            assert sorted(ea) == sorted(eb)
            for tid in ea:
                assert ea[tid].logprob == pytest.approx(eb[tid].logprob, abs=LOGPROB_NOISE)


def _one_by_one(llm, prompts, params=GREEDY):
    return [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts]


def _expected_hit(family: str, shared: int, prompt_len: int) -> int:
    """Tokens a request after the first two resumes from: the shared prefix (a snapshot at the branch point
    for a model with state; for attention only, the KV to the token)."""
    return min(shared, prompt_len - 1)


@pytest.mark.parametrize("family", list(STATE_KINDS))
@pytest.mark.parametrize("shared", [16, 23, 40, 48])
def test_cached_prefixes_give_the_uncached_outputs(ckpt_dir, family, shared):
    off, on = _engines(make(ckpt_dir, family))
    prompts = _prompts(shared, 5, seed=shared)
    want = off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = _one_by_one(on, prompts)
    _assert_same(got, want)
    assert got[0].num_cached_tokens == 0
    for out, p in zip(got[2:], prompts[2:]):  # the second request's branch point serves every later one
        assert out.num_cached_tokens >= _expected_hit(family, shared, len(p)), (family, shared)
    stats = on.engine.prefix_cache_stats()
    assert stats["hits"] == sum(o.num_cached_tokens for o in got)
    assert_drained(on.engine)


@pytest.mark.parametrize("family", list(STATE_KINDS))
def test_turn_two_resumes_from_turn_one_prompt_and_answer(ckpt_dir, family):
    off, on = _engines(make(ckpt_dir, family))
    first = _prompts(30, 1, seed=3)[0]
    one = on.generate([{"prompt_token_ids": first}], GREEDY)[0]
    chat = first + one.outputs[0].token_ids
    turns = [chat + [11, 12, 13], None]
    two = on.generate([{"prompt_token_ids": turns[0]}], GREEDY)[0]
    _assert_same([two], off.generate([{"prompt_token_ids": turns[0]}], GREEDY))
    # the KV (and the state) at the end of turn one's generation (its last token was never run)
    assert two.num_cached_tokens == len(chat) - 1
    assert_drained(on.engine)


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_state_snapshots_in_either_state_dtype(ckpt_dir, ssm_dtype):
    """A resumed prefill stores the state once more (at the snapshot) than a prefill in one chunk: in bfloat16
    that is one more rounding, so logprobs are compared with an uncached run chunked at the same token."""
    path = make(ckpt_dir, "bamba")
    dtypes = dict(mamba_ssm_cache_dtype=ssm_dtype, mamba_cache_dtype=ssm_dtype)
    off, on = _engines(path, **dtypes)
    shared = 37
    prompts = _prompts(shared, 4, seed=7)
    got = _one_by_one(on, prompts)
    plain = off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in plain]
    assert all(g.num_cached_tokens == shared for g in got[2:])
    chunked = LLM(path, enable_prefix_caching=False, cache_memory="8MiB", enable_progress_bar=False,
                  max_num_batched_tokens=shared, **dtypes)
    _assert_same(got[1:], _one_by_one(chunked, prompts[1:]))
    if ssm_dtype == "float32":
        _assert_same(got, plain)
    spec = {t["dtype"] for layer in on.engine.cache_layout()["layers"] for t in layer["tensors"]}
    assert ssm_dtype in spec
    assert on.engine.prefix_cache_stats()["snapshots"] > 0
    assert_drained(on.engine)


def test_a_bfloat16_model_with_float32_state(ckpt_dir):
    import torch

    off, on = _engines(make(ckpt_dir, "bamba", dtype=torch.bfloat16), mamba_ssm_cache_dtype="float32")
    prompts = _prompts(40, 4, seed=11)
    got = _one_by_one(on, prompts)
    want = off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert all(g.num_cached_tokens >= 40 for g in got[2:])
    assert_drained(on.engine)


def test_a_forty_token_shared_prefix_hits(ckpt_dir):
    _, on = _engines(make(ckpt_dir, "bamba"))
    outs = _one_by_one(on, _prompts(40, 6, seed=1))
    assert [o.num_cached_tokens for o in outs][:2] == [0, 0]
    assert all(o.num_cached_tokens == 40 for o in outs[2:])
    stats = on.engine.prefix_cache_stats()
    assert stats["kv_beyond_snapshot"] == 1  # the second request's lookup: KV to 40, no state there yet


@pytest.mark.parametrize("family", ["bamba", "mamba2"])
def test_requests_arriving_together_compute_the_shared_prefix_once(ckpt_dir, family):
    """All at once: the first admitted snapshots where the others leave its prompt, they wait one step and
    resume from there (none computes the shared prefix again)."""
    off, on = _engines(make(ckpt_dir, family), max_num_batched_tokens=256)
    prompts = _prompts(70, 8, seed=21)
    want = off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = on.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _assert_same(got, want)
    assert got[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 70 for o in got[1:])
    assert_drained(on.engine)


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_the_same_prompt_again(ckpt_dir, family):
    """A model with state: the second run of a prompt finds its KV to the last token but no state there (the
    first run snapshotted the prompt's end and its generation's end), so it snapshots at its last prompt
    token, and every later run resumes there. Attention only: the second run resumes there already."""
    llm = _engines(make(ckpt_dir, family))[1]
    prompt = _prompts(50, 1, seed=2)[0]
    runs = [llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0] for _ in range(3)]
    second = 0 if family == "bamba" else len(prompt) - 1
    assert [r.num_cached_tokens for r in runs] == [0, second, len(prompt) - 1]
    assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids == runs[2].outputs[0].token_ids
    assert llm.reset_prefix_cache()
    assert llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].num_cached_tokens == 0


def test_prompt_logprobs_requests_compute_every_position(ckpt_dir):
    off, on = _engines(make(ckpt_dir, "bamba"))
    prompts = _prompts(32, 3, seed=4)
    _one_by_one(on, prompts)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    got = on.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    want = off.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert got.num_cached_tokens == 0
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        for tid in a:
            assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=LOGPROB_NOISE)


def test_prefix_caching_off_caches_nothing(ckpt_dir):
    off, _ = _engines(make(ckpt_dir, "bamba"))
    outs = _one_by_one(off, _prompts(40, 4))
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert off.engine.cache.prefix is None and off.engine.pool.num_live_pages == 0


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_children_share_the_prompt_pages(ckpt_dir, family):
    off, on = _engines(make(ckpt_dir, family), block_size=8)
    prompt = _prompts(35, 1, seed=5)[0]
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    engine = on.engine
    engine.add_request("r", prompt, params)
    shared_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        check_cache_invariants(engine)
        seqs = [s for s in engine.scheduler.running if s.request_id == "r"]
        if len(seqs) == 3:
            full = len(prompt) // 8
            tables = [s.block_table[:full] for s in seqs]
            assert tables[0] == tables[1] == tables[2]
            shared_seen = max(shared_seen, min(engine.cache.page_refs[p] for p in tables[0]))
    assert shared_seen >= 3  # three sequences hold every full prompt page (the index may hold a fourth ref)
    single = off.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6,
                                                                         ignore_eos=True))[0]
    assert_drained(engine)
    with_n = on.generate([{"prompt_token_ids": prompt}], params)[0]
    assert all(c.token_ids == single.outputs[0].token_ids for c in with_n.outputs)


def test_preempting_a_request_that_holds_shared_pages(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    opts = dict(cache_memory="200KiB", enable_progress_bar=False, max_num_batched_tokens=64, block_size=8)
    off, on = LLM(path, enable_prefix_caching=False, **opts), LLM(path, **opts)
    prompts = _prompts(24, 6, seed=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    on.generate([{"prompt_token_ids": p} for p in prompts[:2]], params)  # cache the shared prefix
    got = on.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert on.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all at once"
    want = off.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert_drained(on.engine)


@pytest.mark.parametrize("family", ["bamba", "mamba2", "llama"])
def test_cached_items_are_evicted_before_anything_is_preempted(ckpt_dir, family):
    _, on = _engines(make(ckpt_dir, family), cache_memory="512KiB" if family != "llama" else "96KiB")
    for i in range(12):  # distinct prompts: the cache fills the pool, then is evicted for new requests
        on.generate([{"prompt_token_ids": _prompts(30, 1, seed=100 + i)[0]}], GREEDY)
        check_cache_invariants(on.engine)
    stats = on.engine.prefix_cache_stats()
    assert stats["evicted_snapshots"] + stats["evicted_pages"] > 0
    assert on.engine.scheduler.num_preemptions == 0
    if family == "bamba":  # KV and state in one pool: the pool compacted around cached pages and snapshots
        assert on.engine.pool.stats["compactions"] > 0
    assert_drained(on.engine)


def _tiny_bamba(ckpt_dir, cache_memory: str) -> LLM:
    """Block size 8, no interval snapshots, a pool of a few state slots."""
    return LLM(make(ckpt_dir, "bamba"), cache_memory=cache_memory, block_size=8, enable_progress_bar=False,
               prefix_snapshot_interval=0)


def test_a_hit_that_evicts_requeues_the_page_under_its_snapshot_tail(ckpt_dir):
    """A hit on a snapshot whose tail page has since been filled and indexed holds that page while its room is
    made: the eviction finds the page's node held and drops it from the queue. Once the hit lets go, the node
    (only the cache holds it) is queued again."""
    llm = _tiny_bamba(ckpt_dir, "80KiB")  # two state slots
    prompt = list(range(3, 15))  # 12 tokens: the prompt's snapshot has a 4-token tail in page 1
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine = llm.engine  # cached: pages 0 and 1, the snapshots at 12 and 17 (in both slots)
    engine.add_request("b", prompt + [99, 98, 97], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():  # b resumes at 12; its slot evicts the snapshot at 17
        engine.step()
        check_cache_invariants(engine)
    assert engine.prefix_cache_stats()["evicted_snapshots"] >= 1
    assert_drained(engine)


def test_a_hit_that_does_not_fit_leaves_its_snapshot_evictable(ckpt_dir):
    """A waiting request whose hit cannot get room (two running requests hold the other slots) pins the snapshot
    while eviction runs and fails; the snapshot, only the cache's once the request is aborted, is queued again."""
    llm = _tiny_bamba(ckpt_dir, "112KiB")  # three state slots
    engine = llm.engine
    prompt = list(range(3, 15))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    for i in range(2):  # short prompts: their snapshots are worth less than the cached one and give way
        engine.add_request(f"h{i}", [40 + i] * 5, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        engine.step()
    engine.add_request("b", prompt + [99, 98, 97], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]
    engine.abort_request("b")
    check_cache_invariants(engine)
    for i in range(2):
        engine.abort_request(f"h{i}")
    assert_drained(engine)


def test_an_attach_holds_the_kv_tail_it_copies_while_it_makes_room(ckpt_dir, monkeypatch):
    """Without recurrent state a hit's partly used page is held by a KV-only snapshot. While the attach makes
    room, it holds that page by a reference of its own (the snapshot itself may be evicted meanwhile: the page
    handle it copies from stays valid whatever the pool moves), and lets go of it afterwards."""
    llm = LLM(make(ckpt_dir, "llama"), cache_memory="64KiB", block_size=8, enable_progress_bar=False)
    engine = llm.engine
    prompt = list(range(3, 15))  # 12 tokens: page 0 indexed, the last 4 in a KV tail
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    cache = engine.cache
    seen = []
    make_room = cache.make_room

    def watched(num_pages, num_slots):
        tails = [snap for snaps in cache.prefix._tails.values() for snap in snaps]
        seen.append([(snap.slot, cache.page_refs[snap.tail_page]) for snap in tails])
        return make_room(num_pages, num_slots)

    monkeypatch.setattr(cache, "make_room", watched)
    engine.add_request("b", prompt + [99, 98, 97], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        check_cache_invariants(engine)
    assert engine.prefix_cache_stats()["hits"] == 12
    assert seen[0] == [(None, 2)]  # the attach's first room: the KV tail's page is the snapshot's and the attach's
    monkeypatch.undo()
    assert_drained(engine)


def test_a_failing_cache_update_turns_caching_off_and_loses_nothing(ckpt_dir, monkeypatch):
    off, on = _engines(make(ckpt_dir, "bamba"))
    prompts = _prompts(40, 4, seed=13)
    _one_by_one(on, prompts[:2])  # something cached
    calls = []

    def broken(seqs):
        calls.append(len(seqs))
        if len(calls) == 3:
            raise RuntimeError("injected")

    monkeypatch.setattr(on.engine.cache.prefix, "after_step", broken)
    got = on.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert on.engine.cache.prefix is None and len(calls) == 3
    assert [g.outputs[0].token_ids for g in got] == [
        w.outputs[0].token_ids for w in off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert_drained(on.engine)


def test_index_matches_to_the_token_and_picks_the_longest_snapshot():
    index = PrefixIndex(4)
    a = index.add_child(index.root, (1, 2, 3, 4), 10)
    b = index.add_child(a, (5, 6, 7, 8), 11)
    index.add_snapshot(a, (5,), 0, 11)
    index.add_snapshot(a, (5, 6, 7), 1, 11)
    index.add_snapshot(b, (), 2, None)
    m = index.match([1, 2, 3, 4, 5, 6, 9, 9, 9], limit=8)
    assert [n.page for n in m.path] == [10] and m.kv_tokens == 6 and m.partial is b
    assert m.snapshot.position == 5  # (5, 6, 7) does not match, (5,) does
    m = index.match([1, 2, 3, 4, 5, 6, 7, 8, 1], limit=8)
    assert m.kv_tokens == 8 and m.snapshot.position == 8
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8], limit=7).snapshot.position == 7  # the last token always runs
    assert index.match([2], limit=0).kv_tokens == 0


def test_followers_plan_branch_points_and_wait_for_their_leader():
    from types import SimpleNamespace

    from hybridserve.cache.prefix_sharing import follower_branch_points, shared_tokens, waits_for_leader

    def seq(tokens, done=0, plan=()):
        return SimpleNamespace(prompt_token_ids=tokens, num_computed_tokens=done, snapshot_plan=list(plan),
                               params=SimpleNamespace(prompt_logprobs=None, cache_salt=None))

    base = list(range(3, 43))  # 40 shared tokens
    leader, a, b, short = seq(base + [1, 2]), seq(base + [5]), seq(base + [6, 7]), seq(base[:20] + [9])
    assert shared_tokens(leader.prompt_token_ids, a.prompt_token_ids) == 40
    assert shared_tokens([1, 2], [1, 2]) == 1  # the last token always runs
    assert follower_branch_points(leader, [leader, a, b, short], start=0) == [40]  # 20 shared is too few
    assert follower_branch_points(leader, [a], start=40) == []  # already cached that far
    leader.snapshot_plan = [40, 42]
    assert waits_for_leader(a, [leader]) and not waits_for_leader(short, [leader])
    leader.num_computed_tokens = 40
    assert not waits_for_leader(a, [leader])  # its snapshot is taken: a resumes from it now


def test_bad_prefix_caching_options_are_refused():
    from hybridserve.config import EngineConfig

    with pytest.raises(ValueError, match="prefix_snapshot_interval=-1"):
        EngineConfig(prefix_snapshot_interval=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching='yes'"):
        EngineConfig(enable_prefix_caching="yes")


# ---------------------------------------------------------------- random interleavings
@st.composite
def workloads(draw):
    """Requests over a few shared prefixes, some with a cache salt (a tree of their own), with aborts at random
    steps."""
    prefixes = [draw(st.lists(st.integers(3, 120), min_size=1, max_size=40)) for _ in range(3)]
    requests = []
    for _ in range(draw(st.integers(3, 9))):
        base = prefixes[draw(st.integers(0, 2))]
        cut = draw(st.integers(1, len(base)))
        suffix = draw(st.lists(st.integers(3, 120), min_size=0, max_size=12))
        requests.append(dict(prompt=base[:cut] + suffix, max_tokens=draw(st.integers(1, 10)),
                             arrive=draw(st.integers(0, 12)), abort=draw(st.one_of(st.none(), st.integers(0, 20))),
                             salt=draw(st.sampled_from([None, None, "a", "b"]))))
    return requests


@pytest.fixture(scope="module")
def tight_engines(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    opts = dict(cache_memory="384KiB", enable_progress_bar=False, max_num_batched_tokens=48, block_size=8,
                prefix_snapshot_interval=16)
    return LLM(path, enable_prefix_caching=False, **opts), LLM(path, **opts)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(work=workloads())
def test_random_requests_aborts_and_evictions(tight_engines, work):
    off, on = tight_engines
    engine = on.engine
    finished, step = {}, 0
    pending = sorted(range(len(work)), key=lambda i: work[i]["arrive"])
    while pending or engine.has_unfinished_requests():
        while pending and work[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), work[i]["prompt"], SamplingParams(
                temperature=0, max_tokens=work[i]["max_tokens"], ignore_eos=True, cache_salt=work[i]["salt"]))
        for i, w in enumerate(work):
            if w["abort"] == step and str(i) not in finished:
                engine.abort_request(str(i))
                finished[str(i)] = None
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check_cache_invariants(engine)
        step += 1
    for rid, out in finished.items():
        if out is None or out.outputs[0].finish_reason != "length":
            continue
        w = work[int(rid)]
        want = off.generate([{"prompt_token_ids": w["prompt"]}],
                            SamplingParams(temperature=0, max_tokens=w["max_tokens"], ignore_eos=True))[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids, "a wrong prefix hit"
    assert_drained(engine)
    assert engine.cache.prefix.index.num_salts == 0  # every salt's emptied tree is forgotten
