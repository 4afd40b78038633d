"""8-bit temporal state (``mamba_ssm_cache_dtype`` int8 / fp8_e4m3) on every family that has one.

* Parity: against HF float32 under the near-tie rule (``tests/hf_reference.compare``), as
  ``test_parity.py`` runs it (prompts of mixed lengths, split prefills, queued requests).
* Exactness where it holds by construction: a prefix hit resumes from a snapshot (a copy of the slot's
  codes and scales) and gives the outputs of an uncached run chunked at the same token, bit for bit; forked
  children (n > 1, unseeded: one rounding key) give the single request's outputs bit for bit; the same seed
  gives the same outputs; the rounding keys and positions the codes are rounded with are the request's seed and
  its tokens absorbed.
* A preempted request recomputes its tokens in prefill chunks, which round the state once per chunk where its
  decode steps rounded it once per token: not bit-exact by construction, so its greedy tokens are compared.
* ``cache_layout()`` and ``hybridserve plan --json`` count codes and scales to the byte.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.conv_codec import CodedConvState
from hybridserve.cache.state_codec import CODED_VIEWS, CodedState, rounding_key
from hybridserve.kernels import fallbacks, recurrent_coded
from tests.checkpoints import make
from tests.engine.test_parity import NEW_TOKENS, prompts
from tests.hf_reference import compare, hf_greedy
from tests.prefix_utils import released_everything

#: every family with a temporal state (tests/engine/test_state_precision.py lists the others too)
FAMILIES = ["mamba2", "bamba", "mamba", "falcon_mamba", "jamba", "granitemoehybrid", "nemotron_h", "zamba2",
            "falcon_h1", "minimax", "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "xlstm"]
CODES = ["int8", "fp8_e4m3"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
_HF: dict[str, list] = {}


def _llm(path: str, state: str, **options) -> LLM:
    opts = {"max_num_batched_tokens": 20, "max_num_seqs": 3, "cache_memory": "16MiB", "enable_progress_bar": False,
            **options}
    return LLM(path, mamba_ssm_cache_dtype=state, **opts)


def _outputs(outs) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Every completion's tokens and logprobs, exactly (for bit-for-bit comparisons)."""
    return [(c.token_ids, [sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs])
            for o in outs for c in o.outputs]


#: 8-bit state that drifts past the parity bar on these tiny checkpoints: every divergence is a near tie, but the
#: greedy paths part from HF's before half the tokens. fp8_e4m3 (3 mantissa bits) on KDA and mLSTM (both rounded
#: to nearest; docs/state_precision.md)
PARITY_DRIFTS = {("kimi_linear", "fp8_e4m3"), ("xlstm", "fp8_e4m3")}


def _parity_cases() -> list:
    return [pytest.param(family, state, marks=pytest.mark.xfail(
        strict=True, reason=f"{state} state parts from HF before half the tokens (docs/state_precision.md)"))
        if (family, state) in PARITY_DRIFTS else (family, state)
        for family in FAMILIES for state in CODES]


@pytest.mark.parametrize("family,state", _parity_cases())
def test_eight_bit_state_matches_hf_under_the_near_tie_rule(ckpt_dir, family, state, record_property):
    path = make(ckpt_dir, family)
    llm = _llm(path, state)
    layers = [c.state for c in llm.engine.pool.layer_caches.values() if c.state]
    assert any(isinstance(v, CodedState) for s in layers for v in s.values()), "the pool holds 8-bit codes"
    assert_hf_parity(llm, path, record_property)


def assert_hf_parity(llm: LLM, path: str, record_property) -> None:
    """The parity run: 3 prompts (7, 33, 70 tokens) on ``llm`` against HF float32 on ``path`` under the near-tie
    rule, at least half the tokens compared; records the mean |Δlogprob|."""
    ps = prompts(llm.engine.hf_config.vocab_size)[1::2]  # lengths 7, 33, 70
    if path not in _HF:
        _HF[path] = hf_greedy(path, ps, NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True))
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], _HF[path])
    record_property("mean_abs_logprob_error", cmp.mean_abs_error)
    assert cmp.compared_tokens >= len(ps) * NEW_TOKENS // 2, cmp.diverged_at
    assert released_everything(llm.engine)


@pytest.mark.parametrize("family,state,conv", [
    ("bamba", "int8", "auto"), ("bamba", "fp8_e4m3", "auto"), ("mamba", "int8", "auto"), ("qwen3_next", "int8", "auto"),
    ("minimax", "fp8_e4m3", "auto"), ("kimi_linear", "int8", "auto"), ("xlstm", "int8", "auto"),
    ("bamba", "int8", "int8"), ("qwen3_next", "int8", "int8"), ("lfm2", "auto", "int8")])  # int8 conv state too
def test_a_prefix_hit_gives_the_uncached_outputs_bit_for_bit(ckpt_dir, family, state, conv):
    """The later requests resume from the snapshot at the shared prefix (its codes and scales copied, an 8-bit
    conv state's codes and exponents with them); an uncached engine whose chunk budget ends a chunk at the same
    token computes the very same bits."""
    import random

    path = make(ckpt_dir, family)
    shared = 37
    rng = random.Random(7)
    prefix = [rng.randrange(3, 120) for _ in range(shared)]
    ps = [prefix + [rng.randrange(3, 120) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    on = _llm(path, state, cache_memory="8MiB", max_num_batched_tokens=64, mamba_cache_dtype=conv)
    got = [on.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in ps]
    assert all(g.num_cached_tokens == shared for g in got[2:])
    chunked = _llm(path, state, cache_memory="8MiB", max_num_batched_tokens=shared, enable_prefix_caching=False,
                   mamba_cache_dtype=conv)
    want = [chunked.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in ps[1:]]
    assert _outputs(got[1:]) == _outputs(want)
    assert released_everything(chunked.engine)


@pytest.mark.parametrize("state,conv", [("int8", "auto"), ("fp8_e4m3", "auto"), ("int8", "int8")])
def test_forked_children_equal_the_single_request_bit_for_bit(ckpt_dir, state, conv):
    """``n > 1``: the children start from copies of the parent's slot (an 8-bit conv state's exponents too)."""
    llm = _llm(make(ckpt_dir, "bamba"), state, max_num_batched_tokens=64, enable_prefix_caching=False,
               mamba_cache_dtype=conv)
    ps = [[5, 9, 14, 3, 77, 21, 8, 40, 41, 42, 43, 17, 19, 23, 29, 31, 37, 11, 13], [60, 61, 62]]
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    single = _outputs(llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(**params)))
    forked = _outputs(llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(n=3, **params)))
    assert forked == [single[0]] * 3 + [single[1]] * 3
    assert released_everything(llm.engine)


@pytest.mark.parametrize("kernels", [False, True], ids=["plain-body", "kernel-body"])
def test_the_same_seed_reproduces_and_keys_and_positions_reach_the_codes(ckpt_dir, monkeypatch, kernels):
    """The plain body encodes through ``CodedState.write``, the kernel body passes the keys and positions to
    ``recurrent_coded`` (every step through Python here: no captured replay). Bamba's Mamba2 state rounds
    stochastically."""
    path = make(ckpt_dir, "bamba")
    seen: list[tuple[list[int], list[int]]] = []
    if kernels:
        scan = recurrent_coded.mamba2_scan

        def spy_scan(state, x, dt, A, B, C, D, dt_bias, softplus, dt_limit, cu_seqlens, slots, keys, positions,
                     *rest):
            assert state.stochastic
            seen.append((keys.tolist(), positions.tolist()))
            return scan(state, x, dt, A, B, C, D, dt_bias, softplus, dt_limit, cu_seqlens, slots, keys, positions,
                        *rest)

        monkeypatch.setattr(recurrent_coded, "mamba2_scan", spy_scan)
    else:
        write = CodedState.write

        def spy(self, idx, values, keys, positions):
            seen.append((keys.tolist(), positions.tolist()))
            write(self, idx, values, keys, positions)

        monkeypatch.setattr(CodedState, "write", spy)
    seed = 2**40 + 5  # wider than the 32 bits the hash reads
    params = SamplingParams(temperature=0.9, max_tokens=8, seed=seed, logprobs=2)
    runs = []
    for _ in range(2):
        llm = _llm(path, "int8", cpu_kernels=kernels, enforce_eager=kernels)
        seen.clear()  # (the start-up's capture attempt runs padded rows, key 0)
        runs.append(_outputs(llm.generate([{"prompt_token_ids": list(range(3, 30))}], params)))
    assert runs[0] == runs[1]
    assert {k for keys, _ in seen for k in keys} == {rounding_key(seed)} == {5}
    # a 27-token prompt in chunks of at most 20 tokens, then one position per generated token
    assert sorted({p for _, ps in seen for p in ps}) == [20, 27, *range(28, 35)]


#: how each family's 8-bit temporal state rounds (cache/spec.py: TEMPORAL_ROUNDING): nearest for the delta rules
#: and mLSTM, stochastic for Mamba1, Mamba2 and linear attention
NEAREST_FAMILIES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "xlstm"}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_state_kind_rounds_as_chosen(ckpt_dir, family):
    """The pool's 8-bit views carry their kind's rounding; a nearest one's codes do not depend on the request's
    seed (the same greedy run under two seeds stores the same codes), a stochastic one's do."""
    llm = _llm(make(ckpt_dir, family), "int8", enable_prefix_caching=False, max_num_seqs=1)
    views = [v for c in llm.engine.pool.layer_caches.values() if c.state for v in c.state.values()
             if isinstance(v, CodedState)]
    assert views and {v.stochastic for v in views} == {family not in NEAREST_FAMILIES}
    stored = []
    for seed in (1, 2):  # one sequence at a time, no prefix cache: both requests hold the same slot
        llm.generate([{"prompt_token_ids": list(range(3, 30))}],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, seed=seed))
        stored.append([v.codes.view(torch.uint8).clone() for v in views])
    same = all(torch.equal(a, b) for a, b in zip(*stored))
    assert same == (family in NEAREST_FAMILIES)
    assert released_everything(llm.engine)


def test_a_preempted_request_keeps_its_greedy_tokens(ckpt_dir):
    path = make(ckpt_dir, "bamba")
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (8,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = _llm(path, "int8", max_num_seqs=8, max_num_batched_tokens=2048)
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in ps], params)]
    layout = roomy.cache_layout()
    per_seq = layout["slot_bytes"] + 7 * layout["page_bytes"]
    tight = _llm(path, "int8", cache_memory=3 * per_seq + 64, max_num_seqs=8, max_num_batched_tokens=32)
    got = [o.outputs[0].token_ids for o in tight.generate([{"prompt_token_ids": p} for p in ps], params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert released_everything(tight.engine)


@pytest.mark.parametrize("family,state,conv", [
    ("bamba", "int8", "auto"), ("xlstm", "fp8_e4m3", "auto"), ("kimi_linear", "int8", "auto"),
    ("bamba", "int8", "int8"), ("kimi_linear", "int8", "int8"), ("lfm2", "int8", "int8")])  # int8 conv state too
def test_cache_layout_and_plan_count_codes_and_scales_exactly(ckpt_dir, capsys, family, state, conv):
    """Every coded tensor is two entries, its codes (with their rounding) and its scales (an 8-bit conv state's:
    one int8 exponent per channel), each the bytes the pool holds; ``hybridserve plan --json`` says the same."""
    from hybridserve.entrypoints.cli import main

    path = make(ckpt_dir, family)
    llm = _llm(path, state, mamba_cache_dtype=conv)
    layout = llm.cache_layout()
    assert layout["mamba_ssm_cache_dtype"] == state
    assert layout["mamba_cache_dtype"] == ("int8" if conv == "int8" else "float32")
    total = 0
    for entry in layout["layers"]:
        real = llm.engine.pool.layer_caches[entry["index"]]
        for t in entry["tensors"]:
            if t["per"] != "sequence":
                continue
            total += t["bytes"]
            view = real.state[t.get("scales", t["name"])]
            if "scales" in t:  # the scales of the coded tensor named there
                assert isinstance(view, CODED_VIEWS) and t["name"] == t["scales"] + "_scale"
                tensor = view.scale
                if isinstance(view, CodedConvState):  # one int8 exponent per channel
                    assert t["dtype"] == "int8" and t["shape"] == [view.codes.shape[1]]
            else:
                tensor = view.codes if isinstance(view, CODED_VIEWS) else view
                if isinstance(view, CODED_VIEWS):  # the codes say how they round
                    assert t["rounding"] == ("stochastic" if getattr(view, "stochastic", False) else "nearest")
            assert list(tensor.shape[1:]) == t["shape"] and str(tensor.dtype).removeprefix("torch.") in (
                t["dtype"], {"fp8_e4m3": "float8_e4m3fn"}.get(t["dtype"]))
            assert tensor[0].numel() * tensor.element_size() == t["bytes"]
        assert sum(t["bytes"] for t in entry["tensors"] if t["per"] == "sequence") == entry["state_bytes_per_sequence"]
    assert total == layout["state_bytes_per_sequence"] > 0
    assert layout["slot_bytes"] - total < 64 * sum(len(e["tensors"]) for e in layout["layers"])  # alignment only
    args = ["plan", path, "--json", "--cache-memory=16MiB", f"--mamba-ssm-cache-dtype={state}"]
    assert main(args + ([f"--mamba-cache-dtype={conv}"] if conv != "auto" else [])) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layers"] == layout["layers"]
    for key in ("state_bytes_per_sequence", "slot_bytes", "page_bytes", "mamba_ssm_cache_dtype", "mamba_cache_dtype"):
        assert plan[key] == layout[key], key


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("state", CODES)
def test_the_kernel_bodies_take_coded_state(ckpt_dir, family, state):
    """With the CPU kernels on, every recurrent op of an 8-bit state model runs its kernel body on the codes in
    place (``kernels/recurrent_coded.py``), prefill and decode: no call is handed to the plain body."""
    fallbacks.reset()
    llm = _llm(make(ckpt_dir, family), state, cpu_kernels=True)
    llm.generate([{"prompt_token_ids": list(range(3, 20))}, {"prompt_token_ids": list(range(5, 9))}], GREEDY)
    declined = {(op, reason) for (op, reason), n in fallbacks.counts().items() if n and "state codes" in reason}
    assert declined == set()
    fallbacks.reset()


def test_a_captured_step_takes_rounding_keys_and_positions_as_inputs(ckpt_dir):
    """The captured group's keys and context lengths are the capture's input buffers, written at every replay
    (a state-only model's context lengths too: they are the positions the codes are rounded at)."""
    from hybridserve.engine.decode_capture import CapturedDecode

    llm = _llm(make(ckpt_dir, "mamba2"), "int8", enforce_eager=True)
    pool = llm.engine.pool
    assert not pool.layout.has_kv
    captured = CapturedDecode(llm.engine.runner.model, pool, 4, 64)
    group = captured._batch(2).decode
    assert group is not None and group.rounding_keys is not None
    assert group.rounding_keys.data_ptr() == captured.rounding_keys.data_ptr()
    assert group.seq_lens.data_ptr() == captured.seq_lens.data_ptr()

    class Replayed:  # stands in for a recorded graph: the buffers are what is checked
        def replay(self) -> torch.Tensor:
            return torch.zeros(4, 1)

    captured.graphs = {1: Replayed(), 2: Replayed(), 4: Replayed()}
    slots = pool.allocate(0, 3).slots
    captured.run([5, 6, 7], [9, 20, 3], [], [10, 21, 4], [], slots, None, [7, 2**32 - 1, 0])
    assert captured.rounding_keys.tolist() == [7, 2**32 - 1, 0, 0]  # the padded row: key 0
    assert captured.seq_lens.tolist()[:3] == [10, 21, 4]
    captured.run([5], [30], [], [31], [], slots[:1], None, [12])
    assert captured.rounding_keys.tolist()[0] == 12 and captured.seq_lens.tolist()[0] == 31
