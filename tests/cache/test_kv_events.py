"""KV cache events: replaying what the engine records rebuilds exactly the prefix index's pages."""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder, block_hash
from hybridserve.cache.prefix_index import PageNode, PrefixIndex
from tests.checkpoints import make

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class Mirror:
    """What a subscriber knows: every live block, hash -> (parent hash, its tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                parent = event.parent_block_hash
                assert parent is None or parent in self.blocks  # a chain hangs on a block already told
                for i, h in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                    assert h == block_hash(parent, tokens) and h not in self.blocks
                    self.blocks[h] = (parent, tokens)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    del self.blocks[h]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()

    def prefixes(self) -> set[tuple[int, ...]]:
        """The token prefix each live block ends."""
        def prefix(h):
            parent, tokens = self.blocks[h]
            return (prefix(parent) if parent is not None else ()) + tokens
        return {prefix(h) for h in self.blocks}


def index_prefixes(index: PrefixIndex) -> set[tuple[int, ...]]:
    out = set()
    for item in index.items():
        if isinstance(item, PageNode):
            tokens, node = (), item
            while node.parent is not None:
                tokens, node = node.tokens + tokens, node.parent
            out.add(tokens)
    return out


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_replayed_events_rebuild_the_index_through_hits_branches_and_evictions(ckpt_dir, family):
    llm = LLM(make(ckpt_dir, family), cache_memory="1MiB", enable_progress_bar=False, max_num_batched_tokens=64)
    engine = llm.engine
    engine.enable_kv_events()
    prefix = engine.cache.prefix
    mirror = Mirror()
    rng = random.Random(0)
    shared = [rng.randrange(3, 120) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 120) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    prompts += [[rng.randrange(3, 120) for _ in range(rng.randrange(20, 90))] for _ in range(20)]
    for i, prompt in enumerate(prompts):
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
        events = engine.take_kv_events()
        if i == 0:  # the first prompt's full pages (and its answer's), one chain from the root
            tokens = prompt + list(out.outputs[0].token_ids)
            assert len(events) == 1 and events[0].parent_block_hash is None
            n = len(events[0].token_ids)
            assert n >= len(prompt) // 16 * 16 and list(events[0].token_ids) == tokens[:n]
        if i == 1:  # a branch off the first prompt's two shared pages
            stored = [e for e in events if isinstance(e, BlockStored)]
            assert stored[0].parent_block_hash == block_hash(block_hash(None, tuple(shared[:16])),
                                                             tuple(shared[16:32]))
        mirror.apply(events)
        assert mirror.prefixes() == index_prefixes(prefix.index)
    assert prefix.stats.evicted_pages > 0  # the small pool evicted on the way
    assert engine.reset_prefix_cache()
    mirror.apply(engine.take_kv_events())
    assert mirror.blocks == {}
    llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
    engine._drop_prefix_cache()  # what an internal error in the cache does
    assert engine.take_kv_events() == [AllBlocksCleared()]


def test_events_need_prefix_caching(ckpt_dir):
    llm = LLM(make(ckpt_dir, "bamba"), cache_memory="2MiB", enable_progress_bar=False, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix cach"):
        llm.engine.enable_kv_events()
    assert llm.engine.take_kv_events() == []


def test_recorder_groups_chains_and_removal_runs():
    index, rec = PrefixIndex(4), KVEventRecorder(4)
    a = index.add_child(index.root, (1, 2, 3, 4), 0)
    rec.stored(a)
    b = index.add_child(a, (5, 6, 7, 8), 1)
    rec.stored(b)
    c = index.add_child(a, (9, 9, 9, 9), 2)  # a sibling of b: a new chain hanging on a
    rec.stored(c)
    ha, hb, hc = (rec.hash_of(n) for n in (a, b, c))
    assert rec.take() == [BlockStored((ha, hb), None, (1, 2, 3, 4, 5, 6, 7, 8), 4), BlockStored((hc,), ha, (9,) * 4, 4)]
    assert ha == block_hash(None, (1, 2, 3, 4)) and hb == block_hash(ha, (5, 6, 7, 8))
    assert all(0 <= h < 2 ** 63 for h in (ha, hb, hc))
    for node in (b, c):
        index.remove_leaf(node)
        rec.removed(node)
    assert rec.take() == [BlockRemoved((hb, hc))]
    assert rec.take() == []
