"""The padded rows of captured steps (``engine/decode_capture.py``) hold nothing of the pool: their state slot
and KV write slots are -1 and their context empty, so every kernel skips them.

Checked on one model per kernel kind (Mamba2 conv and scan, attention, Mamba1, mLSTM, lightning attention
with sliding-window attention, gated delta net, KDA with latent attention, a window page group): a replay
with padded rows changes no byte of the pool outside the real rows' own slots and pages, replays with padded
rows stay bit-identical to the eager forward, and capture sets nothing of the pool aside."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.layout import kv_slot
from hybridserve.kernels import gemm
from tests.checkpoints import make
from tests.kernels.helpers import needs_compiler

needs_bf16_kernel = pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build: no capture")

FAMILIES = ["mamba2", "granitemoehybrid_dense", "mamba", "xlstm", "minimax", "qwen3_next", "kimi_linear", "lfm3"]
FILL = 0x3C  # a byte that reads as a small finite number in float32, bfloat16 and float16 alike


def _llm(path, captured: bool) -> LLM:
    # buckets 1, 2, 4: a step of 3 sequences replays bucket 4 with one padded row
    return LLM(path, dtype="bfloat16", enforce_eager=not captured, cache_memory="16MiB", max_num_batched_tokens=32,
               max_num_seqs=4, enable_progress_bar=False)


def _extents(pool, pages: list[int], slot: int | None) -> list[tuple[int, int]]:
    """Byte ranges of the pool that ``pages`` and ``slot`` (handles) cover."""
    layout = pool.layout
    ranges = [(pool.pages.position(p) * layout.page_bytes, layout.page_bytes) for p in pages]
    if slot is not None:
        ranges.append((pool.slots.position(slot) * layout.slot_bytes, layout.slot_bytes))
    return [(start, start + size) for start, size in ranges]


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_rows_write_nowhere(ckpt_dir, family):
    """Three real rows replayed in bucket 4: the bytes that change are the real rows' slots and pages only."""
    llm = _llm(make(ckpt_dir, family, dtype=torch.bfloat16), True)
    captured, pool = llm.engine.runner.captured_decode, llm.engine.pool
    assert captured is not None and captured.bucket(3) == 4
    assert pool.live_handles() == (set(), set())  # capture holds no page and no slot
    layout, bs = pool.layout, pool.layout.block_size
    groups = 2 if layout.has_window else 1  # a page of the full group and one of the window group
    rows = [pool.allocate(groups if layout.has_kv else 0, 1 if layout.has_state else 0) for _ in range(3)]
    pool.buffer.fill_(FILL)
    before = pool.buffer.clone()
    tables = [got.pages[:1] for got in rows]
    window = None
    if layout.has_window:
        window_tables = [got.pages[1:] for got in rows]
        window = ([kv_slot(t, 2, bs) for t in window_tables], window_tables)
    captured.run([5, 6, 7], [2, 2, 2], [kv_slot(t, 2, bs) for t in tables] if layout.has_kv else [], [3, 3, 3],
                 tables if layout.has_kv else [], [got.slots[0] for got in rows] if layout.has_state else [], window)
    changed = (pool.buffer != before).nonzero().flatten().tolist()
    allowed = [r for got in rows for r in _extents(pool, got.pages, got.slots[0] if got.slots else None)]
    stray = [b for b in changed if not any(lo <= b < hi for lo, hi in allowed)]
    assert not stray, f"{len(stray)} bytes outside the real rows changed, the first at {stray[0]}"
    for got in rows:  # and the check sees writes: every real row wrote its own state or KV
        lo, hi = _extents(pool, got.pages, got.slots[0] if got.slots else None)[-1]
        assert not torch.equal(pool.buffer[lo:hi], before[lo:hi])


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_replays_are_bit_identical_to_eager(ckpt_dir, monkeypatch, family):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 128, (n,), generator=g).tolist()} for n in (5, 9, 17, 4)]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=3, ignore_eos=True) for n in (10, 6, 14, 3)]
    llm = _llm(path, True)
    captured = llm.engine.runner.captured_decode
    assert captured is not None
    padded = {"steps": 0}
    real_run = captured.run

    def counting(input_ids, *args, **kwargs):
        rows = len(input_ids) // captured.q
        padded["steps"] += captured.bucket(rows) > rows
        return real_run(input_ids, *args, **kwargs)

    monkeypatch.setattr(captured, "run", counting)
    replayed = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert padded["steps"] >= 2, "no replay had padded rows"
    eager = [o.outputs[0] for o in _llm(path, False).generate(prompts, params)]
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert a.token_ids == b.token_ids, f"prompt {i}: tokens differ"
        assert [{t: lp.logprob for t, lp in step.items()} for step in a.logprobs] == \
               [{t: lp.logprob for t, lp in step.items()} for step in b.logprobs], f"prompt {i}: logprobs differ"
