"""Sliding-window attention and its page group (docs/sliding_window.md), on LFM3's tiny checkpoint.

The checkpoint's window is 8 tokens, shorter than the prompts and the generations here, so every run
decodes past it: its sliding-window layers attend to the last 8 positions, their pages behind that go
back to the pool while the request runs, and its full-attention layer keeps every page.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.capacity import pages_for, window_pages
from hybridserve.kernels import attention as attention_kernels
from hybridserve.ops.paged_attention import paged_attention, paged_attention_ref
from tests.checkpoints import make
from tests.hf_reference import compare, hf_greedy, hf_model
from tests.prefix_utils import assert_drained, check_cache_invariants, released_everything

WINDOW = 8  # tests/checkpoints.py: lfm3_config
PROMPT_LENGTHS = [3, 20, 45]  # one inside the window, two past it
NEW_TOKENS = 40  # past the window


def _prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def _greedy(tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, logprobs=5, ignore_eos=True, **kw)


def _assert_matches_hf(path: str, prompts: list[list[int]], outs, new_tokens: int = NEW_TOKENS) -> None:
    refs = hf_greedy(path, prompts, new_tokens)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.diverged_at == [None] * len(prompts), cmp.diverged_at
    assert cmp.compared_tokens == len(prompts) * new_tokens
    assert cmp.max_topk_error <= 1e-3, cmp.max_topk_error


@torch.inference_mode()
def _hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """HF float32 log-softmax after every position of ``ids``, in one forward: (len(ids), V)."""
    logits = hf_model(path)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


# ----------------------------------------------------------------------------------------------------- kernels


def _dense_reference(q, keys, values, q_positions, window, scale):
    """HF's sliding-window rule on dense K/V: query position p sees keys k with p - window < k <= p."""
    kpos = torch.arange(keys.shape[0])
    out = []
    rep = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)  # (L, Hq, Dh)
    for i, p in enumerate(q_positions):
        seen = (kpos <= p) & (kpos > p - window)  # (L,)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k[seen].double()) * scale
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v[seen].double()))
    return torch.stack(out).float()


@pytest.mark.parametrize("window", [1, 5, 8, 16, 23])
@pytest.mark.parametrize("q_len", [1, 6])
def test_attention_sees_exactly_the_window_and_never_a_released_page(window, q_len):
    """Decode (one query) and a prefill chunk (six) at context lengths across block boundaries: the fallback,
    the reference and the CPU kernel give HF's window (the current token and the window - 1 before it), with
    every page wholly behind the first query's window poisoned with NaN and its table entry on page 0."""
    torch.manual_seed(window * 10 + q_len)
    bs, hkv, hq, dh, scale = 4, 2, 4, 16, 0.25
    lengths = [q_len + 2, 17, 30, 41]
    num_blocks = 2 + sum(-(-n // bs) for n in lengths)
    k_cache = torch.randn(num_blocks, bs, hkv, dh)
    v_cache = torch.randn(num_blocks, bs, hkv, dh)
    tables, dense, free = [], [], 2  # page 0: the stand-in for released entries; page 1 spare
    width = max(-(-n // bs) for n in lengths)
    for n in lengths:
        nb = -(-n // bs)
        pages = list(range(free, free + nb))
        free += nb
        dense.append((k_cache[pages].reshape(-1, hkv, dh)[:n].clone(), v_cache[pages].reshape(-1, hkv, dh)[:n].clone()))
        first = max(0, n - q_len - window + 1) // bs  # the first block the first query reads
        for b in range(first):
            k_cache[pages[b]], v_cache[pages[b]] = float("nan"), float("nan")
            pages[b] = 0
        tables.append(pages + [0] * (width - nb))
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    block_tables = torch.tensor(tables)
    seq_lens = torch.tensor(lengths)
    cu = torch.arange(len(lengths) + 1) * q_len
    q = torch.randn(len(lengths) * q_len, hq, dh)
    want = torch.cat([_dense_reference(q[i * q_len:(i + 1) * q_len], k, v, range(n - q_len, n), window, scale)
                      for i, (n, (k, v)) in enumerate(zip(lengths, dense))])
    args = (q, k_cache, v_cache, block_tables, seq_lens, cu, scale, 1.0, 1.0, window)
    for got in (paged_attention(*args), paged_attention_ref(*args)):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if attention_kernels.available():
        out = torch.empty_like(q)
        assert attention_kernels.paged_attention(*args, out)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ vs HF float32


@pytest.mark.parametrize("budget", [5, 16, 64])
@pytest.mark.parametrize("kernels", [True, False])
def test_decode_past_the_window_matches_hf(ckpt_dir, kernels, budget):
    """Prompts shorter and longer than the window, 40 new tokens, prefill chunks of 5 and 16 tokens (chunks
    that start inside and behind the window) and one chunk: tokens and top-5 logprobs vs HF float32, on the
    CPU kernels and on the PyTorch fallbacks."""
    path = make(ckpt_dir, "lfm3")
    llm = LLM(path, max_num_batched_tokens=budget, max_num_seqs=3, cache_memory="16MiB", cpu_kernels=kernels,
              enable_progress_bar=False)
    assert llm.engine.pool.layout.window == WINDOW
    ps = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], _greedy())
    _assert_matches_hf(path, ps, outs)
    assert llm.engine.cache.window_pages_released > 0
    assert released_everything(llm.engine)


def test_block_size_8_window_5_matches_hf(ckpt_dir):
    """A window that is no multiple of the block (5 tokens, blocks of 8) and chunks of 7."""
    path = make(ckpt_dir, "lfm3", sliding_window=5)
    llm = LLM(path, max_num_batched_tokens=7, cache_memory="16MiB", block_size=8, enable_progress_bar=False)
    ps = _prompts([4, 13, 29], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], _greedy())
    _assert_matches_hf(path, ps, outs)
    assert released_everything(llm.engine)


# --------------------------------------------------------------------------------------- pages back to the pool


@pytest.mark.parametrize("block_size", [16, 8])
def test_window_pages_go_back_to_the_pool_while_decoding(ckpt_dir, block_size):
    """One request of 30 + 100 tokens, step by step (prefix caching off, so nothing else holds pages): the
    full layer's pages grow with the context, the window layers' stay at the pages of the last 8 positions,
    and the pool holds exactly the two."""
    path = make(ckpt_dir, "lfm3")
    llm = LLM(path, cache_memory="16MiB", block_size=block_size, enable_prefix_caching=False,
              enable_progress_bar=False)
    engine, cache = llm.engine, llm.engine.cache
    bound = math.ceil((WINDOW - 1) / block_size) + 1  # pages holding 8 consecutive positions, at most
    prompt = _prompts([30])[0]
    engine.add_request("r", prompt, _greedy(100))
    held_after_window, full_pages = [], []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            held = cache.window_pages_held(seq)
            assert len(seq.window_table) == len(seq.block_table) == pages_for(engine.pool.layout, seq.num_tokens - 1)
            assert engine.pool.num_live_pages == len(seq.block_table) + held
            released = seq.window_table[:max(0, seq.num_computed_tokens - WINDOW + 1) // block_size]
            assert released == [-1] * len(released)  # everything wholly behind the next token's window
            held_after_window.append(held)
            full_pages.append(len(seq.block_table))
            check_cache_invariants(engine)
    assert max(held_after_window) <= bound
    assert held_after_window[-1] == bound or held_after_window[-1] == bound - 1
    # seen last after 128 of the 130 tokens ran (the step of the 129th samples the last token and finishes)
    assert full_pages[-1] == pages_for(engine.pool.layout, 128)  # the full layer keeps every page
    assert cache.window_pages_released == full_pages[-1] - held_after_window[-1]  # the rest went back already
    assert released_everything(engine)


def test_preemption_recomputes_past_the_window(ckpt_dir):
    """A pool too small for four 40 + 60 token requests at once: some are preempted (recomputed from their
    tokens) and every output still matches HF."""
    path = make(ckpt_dir, "lfm3")
    llm = LLM(path, cache_memory="160KiB", max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False,
              enable_progress_bar=False)
    ps = _prompts([40, 41, 42, 43], seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], _greedy(60))
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_matches_hf(path, ps, outs, 60)
    assert released_everything(llm.engine)


# ------------------------------------------------------------------------------------------------------ n > 1


def test_forked_children_share_the_window_and_match_hf(ckpt_dir):
    """n = 3 sampled children of a 30-token prompt, 40 tokens each: every child's logprobs of its own tokens
    are HF's (teacher-forced, float32); greedy children equal the single request."""
    path = make(ckpt_dir, "lfm3")
    llm = LLM(path, cache_memory="16MiB", enable_progress_bar=False)
    prompt = _prompts([30], seed=9)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=40, logprobs=3, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for child in out.outputs:
        ref = _hf_logprobs(path, prompt + child.token_ids)[len(prompt) - 1:-1]  # (40, V)
        for i, (tok, entries) in enumerate(zip(child.token_ids, child.logprobs)):
            assert tok in entries
            for tid, lp in entries.items():
                assert abs(lp.logprob - float(ref[i, tid])) <= 1e-3, (i, tid)
    single = llm.generate({"prompt_token_ids": prompt}, _greedy())[0]
    forked = llm.generate({"prompt_token_ids": prompt}, _greedy(n=2))[0]
    assert [c.token_ids for c in forked.outputs] == [single.outputs[0].token_ids] * 2
    assert released_everything(llm.engine)


# ------------------------------------------------------------------------------------------------ prefix caching


def test_prefix_hits_restore_the_window_from_snapshots(ckpt_dir):
    """Prompts sharing 40 tokens (5 windows), then each extended by its answer (a chat's next turn): with
    prefix caching on, later requests resume from snapshots, which hold the window layers' pages of the 8
    positions before them, and the outputs equal those with caching off."""
    path = make(ckpt_dir, "lfm3")
    opts = dict(cache_memory="8MiB", max_num_batched_tokens=64, enable_progress_bar=False)
    off, on = LLM(path, enable_prefix_caching=False, **opts), LLM(path, **opts)
    shared = _prompts([40], seed=11)[0]
    prompts = [shared + tail for tail in _prompts([5, 9, 3, 12], seed=12)]
    want = off.generate([{"prompt_token_ids": p} for p in prompts], _greedy(20))
    got = [on.generate([{"prompt_token_ids": p}], _greedy(20))[0] for p in prompts]
    turn2 = [p + o.outputs[0].token_ids + [7, 8, 9] for p, o in zip(prompts[:2], got)]
    want += off.generate([{"prompt_token_ids": p} for p in turn2], _greedy(20))
    got += [on.generate([{"prompt_token_ids": p}], _greedy(20))[0] for p in turn2]
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert sorted(ea) == sorted(eb)
            for tid in ea:
                assert ea[tid].logprob == pytest.approx(eb[tid].logprob, abs=1e-4)
    assert got[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 40 for o in got[2:4])  # the branch point at the shared prefix's end
    assert all(o.num_cached_tokens >= len(p) for o, p in zip(got[4:], prompts[:2]))  # turn 1's prompt and answer
    prefix, bs = on.engine.cache.prefix, on.engine.cache.block_size
    snaps = [item for item in prefix.index.items() if hasattr(item, "slot") and item.slot is not None]
    assert snaps
    for snap in snaps:  # each holds the window pages of the blocks its next token reads, no more
        first = max(0, snap.position - WINDOW + 1) // bs
        assert len(snap.window_pages) == -(-snap.position // bs) - first
    check_cache_invariants(on.engine)
    assert_drained(on.engine)


def test_window_layers_without_state_get_no_hits(ckpt_dir):
    """A model of attention layers alone, some windowed: the index's pages cannot restore the window layers
    (no snapshot holds them), so a repeated prompt is computed again, with the same outputs."""
    path = make(ckpt_dir, "lfm3", layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                num_hidden_layers=3)
    llm = LLM(path, cache_memory="8MiB", enable_progress_bar=False)
    assert llm.engine.pool.layout.window == WINDOW and not llm.engine.pool.layout.has_state
    prompt = _prompts([37], seed=2)[0]
    first = llm.generate({"prompt_token_ids": prompt}, _greedy(12))[0]
    again = llm.generate({"prompt_token_ids": prompt}, _greedy(12))[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _assert_matches_hf(path, [prompt], [again], 12)
    assert_drained(llm.engine)


@pytest.mark.parametrize("shared", [16, 23, 40])
def test_shared_prefix_suite(ckpt_dir, shared):
    """tests/cache/test_prefix_caching.py's exactness check on LFM3 (its family table lists the state kinds)."""
    from tests.cache.test_prefix_caching import test_cached_prefixes_give_the_uncached_outputs

    test_cached_prefixes_give_the_uncached_outputs(ckpt_dir, "lfm3", shared)


def test_chat_turn_suite(ckpt_dir):
    from tests.cache.test_prefix_caching import test_turn_two_resumes_from_turn_one_prompt_and_answer

    test_turn_two_resumes_from_turn_one_prompt_and_answer(ckpt_dir, "lfm3")


# ------------------------------------------------------------------------------------------------------ planner


@pytest.mark.parametrize("options", [{"kv_cache_dtype": "fp8_e4m3", "mamba_cache_dtype": "float32"}, {}])
def test_planner_counts_the_window_for_a_real_size_lfm3(options):
    """LFM3-1.7B's defaults (6 full-attention and 5 sliding-window layers, 4 KV heads of 128, window 256; 13
    short-conv layers of 2048 x 6): the planner's bytes per sequence are the conv state, every page of the
    full layers and 17 pages of the window layers (256 positions span at most 17 blocks of 16), in pages of
    the full layers' size; the torch-free plan (``hybridserve plan``) says the same."""
    from hybridserve.config import EngineConfig
    from hybridserve.planning.plan_config import PlanConfig
    from hybridserve.planning.planner import load_config, plan_cache
    from tests.cache.real_configs import lfm3_defaults

    config = lfm3_defaults()
    plan = plan_cache(config, EngineConfig(cache_memory=80 * 2**30, **options))
    kv = 1 if options.get("kv_cache_dtype") else 2
    conv = 4 if options.get("mamba_cache_dtype") == "float32" else 2
    page = 16 * 6 * 2 * 4 * 128 * kv  # 16 tokens of K and V of the 6 full layers (the larger group)
    slot = 13 * 2048 * 6 * conv
    layout = plan.layout
    assert (layout.window, layout.page_bytes, layout.slot_bytes) == (256, page, slot)
    assert layout.window_kv_bytes_per_token == 5 * 2 * 4 * 128 * kv
    for tokens in (100, 256, 4096, 131072):
        full = -(-tokens // 16)
        assert window_pages(layout, tokens) == min(full, 17)
        assert plan_cache(config, EngineConfig(cache_memory=80 * 2**30, **options),
                          max_model_len=tokens).bytes_per_sequence == slot + (full + min(full, 17)) * page
    no_window = slot + -(-131072 // 16) * 16 * 11 * 2 * 4 * 128 * kv  # every layer's KV for the whole context
    long = plan_cache(config, EngineConfig(cache_memory=80 * 2**30, **options), max_model_len=131072)
    assert long.bytes_per_sequence < 0.56 * no_window  # 6 of 11 attention layers hold the context
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**config.to_diff_dict(), "architectures": ["Lfm3ForCausalLM"]}, f)
        torch_free = plan_cache(load_config(tmp), PlanConfig(cache_memory=80 * 2**30, **options),
                                max_model_len=4096)
    assert torch_free.layout.window == 256
    assert torch_free.bytes_per_sequence == plan_cache(config, EngineConfig(cache_memory=80 * 2**30, **options),
                                                       max_model_len=4096).bytes_per_sequence


def test_prefix_suite_arrivals_forks_and_evictions(ckpt_dir):
    """tests/cache/test_prefix_caching.py's checks of requests arriving together, children sharing the prompt's
    pages and cached items evicted before any preemption, on LFM3."""
    from tests.cache import test_prefix_caching as suite

    suite.test_requests_arriving_together_compute_the_shared_prefix_once(ckpt_dir, "lfm3")
    suite.test_children_share_the_prompt_pages(ckpt_dir, "lfm3")
    suite.test_cached_items_are_evicted_before_anything_is_preempted(ckpt_dir, "lfm3")


@pytest.fixture(scope="module")
def tight_lfm3(ckpt_dir):
    """A pool of about 20 pages and a handful of slots: requests, snapshots and cached pages compete, the pool
    compacts and evicts; snapshots every 16 tokens (each holding window pages)."""
    path = make(ckpt_dir, "lfm3")
    opts = dict(cache_memory="192KiB", enable_progress_bar=False, max_num_batched_tokens=24, block_size=8,
                prefix_snapshot_interval=16, max_num_seqs=4)
    return LLM(path, enable_prefix_caching=False, **opts), LLM(path, **opts)


def _random_workload(seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 120) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    work = []
    for _ in range(rng.randrange(3, 9)):
        base = prefixes[rng.randrange(3)]
        prompt = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(3, 120) for _ in range(rng.randrange(13))]
        work.append(dict(prompt=prompt, max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 2]),
                         arrive=rng.randrange(13), abort=rng.choice([None, None, rng.randrange(21)])))
    return work


@pytest.mark.parametrize("seed", range(12))
def test_random_requests_forks_aborts_and_evictions(tight_lfm3, seed):
    """Random requests over shared prefixes (some with n = 2, some aborted) in a tight pool, step by step:
    the reference counts add up after every step, every request that ran to its length gives the tokens of
    an uncached run, and nothing leaks."""
    off, on = tight_lfm3
    engine, work = on.engine, _random_workload(seed)
    finished, step = {}, 0
    pending = sorted(range(len(work)), key=lambda i: work[i]["arrive"])
    while pending or engine.has_unfinished_requests():
        while pending and work[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), work[i]["prompt"], SamplingParams(
                n=work[i]["n"], temperature=0, max_tokens=work[i]["max_tokens"], ignore_eos=True))
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
        if out is None or any(c.finish_reason != "length" for c in out.outputs):
            continue
        w = work[int(rid)]
        want = off.generate([{"prompt_token_ids": w["prompt"]}],
                            SamplingParams(temperature=0, max_tokens=w["max_tokens"], ignore_eos=True))[0]
        assert all(c.token_ids == want.outputs[0].token_ids for c in out.outputs), "a wrong prefix hit"
    assert_drained(engine)
