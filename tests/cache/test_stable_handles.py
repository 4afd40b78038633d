"""Stable page and slot handles (``cache/handle_map.py``): compaction moves bytes and rewrites only the pool's
handle -> position map; every holder keeps its handles, and the steps (eager, captured decode, captured
verification) read the moved bytes through the map."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.handle_map import HandleMap
from tests.checkpoints import make
from tests.prefix_utils import check_cache_invariants, released_everything

#: draft every step (n-gram, 3 tokens) so verification slots and captured verifications are in play constantly
SPECULATE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "acceptance_floor": 0.0,
             "disable_by_batch_size": 8}


def test_handle_map_binds_moves_and_translates():
    handles = HandleMap(6, "KV page")
    assert [handles.bind(p) for p in (5, 4)] == [5, 4]  # the identity until something moves
    rows = torch.tensor([5 * 8 + 3])
    assert handles.identity and handles.positions(rows) is rows and handles.kv_rows(rows, 8) is rows  # no gather
    handles.move(5, 1)
    assert not handles.identity  # compaction: the item of handle 5 now lives at position 1
    assert handles.position(5) == 1 and handles.handle_at(1) == 5
    assert handles.bind(5) == 0  # handle 5 is held: a new item at position 5 gets the lowest free handle
    assert handles.positions(torch.tensor([[5, 4], [0, 5]])).tolist() == [[1, 4], [5, 1]]
    assert handles.kv_rows(torch.tensor([5 * 8 + 3, 4 * 8]), 8).tolist() == [1 * 8 + 3, 4 * 8]
    assert handles.positions_np([0, 5]).tolist() == [5, 1]
    assert handles.unbind(5) == 1
    assert not handles.identity  # handle 0 is still at position 5
    assert handles.unbind(0) == 5 and handles.identity  # no displaced item left: translating is a no-op again
    with pytest.raises(ValueError, match="KV page 5 is not allocated"):
        handles.unbind(5)
    with pytest.raises(ValueError, match="KV page 9 is not allocated"):
        handles.check(9)


def _prompts(count: int, seed: int) -> list[list[int]]:
    """A shared prefix (prefix-cache hits) and a repeated pattern (n-gram drafts find matches); long enough that
    the KV pages reach down into the state slots' way and compaction lifts pages as well as slots."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 120) for _ in range(60)]
    out = []
    for _ in range(count):
        pattern = [rng.randrange(3, 120) for _ in range(rng.randrange(2, 5))]
        out.append(shared + pattern * rng.randrange(10, 30))
    return out


def _holdings(engine) -> dict:
    """Every handle held now, with the bytes behind it: sequences' tables and slots, cached pages and snapshots."""
    pool, cache = engine.pool, engine.cache
    pb, sb = pool.layout.page_bytes, pool.layout.slot_bytes

    def page(handle):
        b = pool.pages.position(handle)
        return pool.buffer[b * pb:(b + 1) * pb].clone()

    def slot(handle):
        s = pool.slots.position(handle)
        return pool.buffer[s * sb:(s + 1) * sb].clone()

    held = {}
    for key, seq in cache._holders.items():
        held[("seq", key)] = (list(seq.block_table), seq.state_slot, seq.spec_slot)
        for h in seq.block_table:
            held[("page", h)] = page(h)
        if seq.state_slot is not None:
            held[("slot", seq.state_slot)] = slot(seq.state_slot)
    for item in cache.prefix.index.items():
        if hasattr(item, "slot"):
            held[("snapshot", id(item))] = (item.slot, item.tail_page)
            if item.slot is not None:
                held[("slot", item.slot)] = slot(item.slot)
        elif item.page is not None:
            held[("node", id(item))] = item.page
            held[("page", item.page)] = page(item.page)
    return held


def _same(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(
        torch.equal(a, after[k]) if isinstance(a, torch.Tensor) else a == after[k] for k, a in before.items())


def test_compaction_under_a_running_batch_keeps_handles_and_tokens(ckpt_dir, monkeypatch):
    """A pool small enough to compact while requests run, with the prefix cache, n-gram speculation and
    captured decode and verification steps all on, gives the tokens of a pool that never compacts; across
    every compaction each handle held keeps its bytes, and captured steps replay on both sides of one."""
    path = make(ckpt_dir, "bamba")
    prompts = _prompts(12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    opts = dict(enable_progress_bar=False, max_num_batched_tokens=64, block_size=8, speculative_config=SPECULATE)
    roomy = LLM(path, cache_memory="16MiB", **opts)
    roomy.generate([{"prompt_token_ids": p} for p in prompts[:6]], params, use_tqdm=False)
    want = roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert roomy.engine.pool.stats["compactions"] == 0

    tight = LLM(path, cache_memory="1100KiB", **opts)  # 35 slots: requests, verification slots and snapshots
    tight.generate([{"prompt_token_ids": p} for p in prompts[:6]], params, use_tqdm=False)  # cached snapshots
    engine = tight.engine
    pool = engine.pool
    assert engine.runner.captured_decode is not None and engine.runner.captured_steps
    compactions = []
    make_room = pool.make_room

    def watched(num_pages, num_slots):  # every holder's handles and their bytes survive the move
        before, epoch, pages_live = _holdings(engine), pool.epoch, list(pool._live_pages)
        make_room(num_pages, num_slots)
        if pool.epoch != epoch:
            compactions.append((_same(before, _holdings(engine)), pages_live != list(pool._live_pages)))

    monkeypatch.setattr(pool, "make_room", watched)
    replay_epochs = []
    for captured in [engine.runner.captured_decode, *engine.runner.captured_steps.values()]:
        def counted(*args, _run=captured.run, **kwargs):
            replay_epochs.append(pool.epoch)
            return _run(*args, **kwargs)
        monkeypatch.setattr(captured, "run", counted)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outputs = {}
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        check_cache_invariants(engine)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [w.outputs[0].token_ids for w in want]
    assert compactions and all(same for same, _ in compactions), "a compaction changed a held handle or its bytes"
    assert any(pages_moved for _, pages_moved in compactions), "no compaction moved a KV page"
    assert len(set(replay_epochs)) > 1, "no captured step replayed after a compaction"
    assert engine.speculator.stats.num_drafts > 0 and engine.prefix_cache_stats()["hits"] > 0
    monkeypatch.undo()
    assert released_everything(engine)


def _decode_beside_a_compaction(llm, fillers: bool, monkeypatch) -> tuple[list, list, int]:
    """Request ``a`` decodes (captured steps) while, with ``fillers``, slots taken beside it for a moment make the
    pool lift its KV pages into the room a finished request ``b`` left above them. Returns a's tokens and
    logprobs and the compactions it saw."""
    engine, pool = llm.engine, llm.engine.pool
    epoch = pool.epoch
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    engine.add_request("b", list(range(3, 103)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()  # b's 13 pages at the top of the pool, below the padding page
    engine.add_request("a", [7, 8, 9, 10] * 10, params)
    replay_epochs = []
    captured = engine.runner.captured_decode
    assert captured is not None

    def counted(*args, **kwargs):
        replay_epochs.append(pool.epoch)
        return real(*args, **kwargs)

    real = captured.run
    monkeypatch.setattr(captured, "run", counted)
    outputs = {}
    while "b" not in outputs:
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    assert engine.reset_prefix_cache() is False  # b's cached pages go; a's (which it holds) stay
    for _ in range(2):  # a's replays write its table into the capture's first row, at the current positions
        engine.step()
    a = next(seq for seq in engine.scheduler.running if seq.request_id == "a")
    held = (list(a.block_table), a.state_slot)
    taken = []
    if fillers:  # slots up to the pages' bottom: the pool must move a's pages (cheaper than any slot) up
        first = pool.pages.position(a.block_table[0])
        while pool.pages.position(a.block_table[0]) == first and len(taken) < pool.num_slots:
            taken.append(engine.cache.ledger.allocate(0, 1).slots[0])
        assert pool.pages.position(a.block_table[0]) != first, "the fillers did not make the pool move a's pages"
        assert (list(a.block_table), a.state_slot) == held  # a's handles are the ones it held before
        for slot in taken:  # (zeroed when taken: a's old page positions hold zeros now)
            engine.cache.ledger.free_slot(slot)
    while "a" not in outputs:
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    monkeypatch.undo()
    assert replay_epochs and replay_epochs[-1] == pool.epoch  # a's last steps were replays after any compaction
    assert released_everything(engine)
    out = outputs["a"].outputs[0]
    return out.token_ids, [{t: lp.logprob for t, lp in entry.items()} for entry in out.logprobs], pool.epoch - epoch


def test_captured_steps_read_pages_a_compaction_moved(ckpt_dir, monkeypatch):
    """A running request's KV pages are moved by a compaction between two of its captured steps: the replays
    translate its unchanged handles to the new positions (the old ones are zeroed state slots by then), and its
    tokens and logprobs are those of the same run without the compaction, bit for bit."""
    llm = LLM(make(ckpt_dir, "bamba"), cache_memory="1100KiB", block_size=8, enable_progress_bar=False,
              max_num_batched_tokens=128)
    still_tokens, still_logprobs, none = _decode_beside_a_compaction(llm, False, monkeypatch)
    moved_tokens, moved_logprobs, compactions = _decode_beside_a_compaction(llm, True, monkeypatch)
    assert none == 0 and compactions > 0
    assert moved_tokens == still_tokens
    assert moved_logprobs == still_logprobs
