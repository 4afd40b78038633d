"""Tensor parallelism on the CPU (gloo): 2 ranks against 1 on tiny checkpoints of every family that shards.

Each TP-2 engine starts one worker process; the checks share engines where they can.
"""

import os
import signal
import time

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.distributed.group import TensorParallelError
from hybridserve.models.loader import load_hf_config
from hybridserve.planning.plan_config import PlanConfig
from hybridserve.planning.planner import plan_cache
from tests.checkpoints import add_mtp_weights, make
from tests.prefix_utils import released_everything

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

#: test id -> (family, checkpoint overrides): head counts TP 2 can split
FAMILIES = {
    "llama": ("llama", {}), "mamba2": ("mamba2", {}), "bamba": ("bamba", {}),
    "granitemoehybrid": ("granitemoehybrid", {}), "granitemoehybrid_dense": ("granitemoehybrid_dense", {}),
    "nemotron_h": ("nemotron_h", {}), "nemotron_h_latent": ("nemotron_h_latent", {}), "zamba2": ("zamba2", {}),
    "falcon_h1": ("falcon_h1", {}), "qwen3_next": ("qwen3_next", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {"linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    # one group on 2 ranks: B and C on both, the gated norm's sums of squares summed over them
    "mamba2_one_group": ("mamba2", {"n_groups": 1}), "bamba_one_group": ("bamba", {"mamba_n_groups": 1}),
    "qwen3_5": ("qwen3_5", {"linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    "olmo_hybrid": ("olmo_hybrid", {}),
    "olmo_hybrid_grouped": ("olmo_hybrid", {"linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    "mamba": ("mamba", {}), "falcon_mamba": ("falcon_mamba", {}),
    "jamba": ("jamba", {}), "lfm2": ("lfm2", {}), "lfm2_moe": ("lfm2_moe", {}), "lfm3": ("lfm3", {}),
    "minimax": ("minimax", {}), "kimi_linear": ("kimi_linear", {}), "xlstm": ("xlstm", {}),
}


def _prompts(n: int, seed: int = 3, longest: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (n,), generator=g).tolist()
    return [torch.randint(3, 128, (L,), generator=g).tolist() for L in lengths]


def _gen(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_same(tp1, tp2) -> None:
    """Greedy tokens equal, the sampled tokens' logprobs within float32 noise."""
    for a, b in zip(tp1, tp2):
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids
            if x.logprobs is not None:
                for tid, lx, ly in zip(x.token_ids, x.logprobs, y.logprobs):
                    assert abs(lx[tid].logprob - ly[tid].logprob) < 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_matches_tp1(ckpt_dir, family):
    """Prompts of several lengths, chunked prefill (16-token budget), decoding, then a second turn resumed
    from the prefix cache (the snapshot copies replayed on rank 1): TP 2 gives TP 1's tokens."""
    name, overrides = FAMILIES[family]
    path = make(ckpt_dir, name, **overrides)
    prompts = [list(range(3, 40))] + _prompts(3, longest=40)
    opts = dict(cache_memory="16MiB", max_num_batched_tokens=16, enable_progress_bar=False)
    tp1 = LLM(path, **opts)
    expected = _gen(tp1, prompts)
    turn2 = [prompts[0] + expected[0].outputs[0].token_ids + [5, 6]]  # resumes from the end of turn 1
    expected2 = _gen(tp1, turn2)
    llm = LLM(path, tensor_parallel_size=2, **opts)
    try:
        _assert_same(expected, _gen(llm, prompts))
        _assert_same(expected2, _gen(llm, turn2))
        plan = plan_cache(load_hf_config(path), PlanConfig(tensor_parallel_size=2, cache_memory="16MiB")).summary()
        layout = llm.cache_layout()
        for key in ("page_bytes", "slot_bytes", "num_pages", "num_slots", "kv_bytes_per_token",
                    "state_bytes_per_sequence"):
            assert plan[key] == layout[key], key  # the plan's figures are one rank's, as the engine's
        hits = llm.engine.prefix_cache_stats()["hits"]
        assert hits == tp1.engine.prefix_cache_stats()["hits"]
        assert hits > 0
        assert released_everything(llm.engine)
        report = llm.engine.cpu_fast_paths.as_dict() if llm.engine.cpu_fast_paths is not None else None
        if report is not None:
            assert "tensor parallel" in report["decode"]["reason"]
    finally:
        llm.engine.shutdown()


def test_tp2_preemption_forks_and_ngram(ckpt_dir):
    """One TP-2 engine with a pool too small for every request (preemption), n = 2 (forked state) and
    n-gram speculation: TP 1's greedy tokens throughout."""
    path = make(ckpt_dir, "bamba")
    prompts = _prompts(6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLM(path, cache_memory="16MiB", max_num_seqs=8, enable_progress_bar=False)
    expected = _gen(roomy, prompts, params)
    layout = roomy.cache_layout()
    per_seq = layout["slot_bytes"] + 6 * layout["page_bytes"]  # one rank holds about half of each
    llm = LLM(path, tensor_parallel_size=2, cache_memory=3 * per_seq // 2 + 64, max_num_seqs=8,
              max_num_batched_tokens=32, enable_progress_bar=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        _assert_same(expected, _gen(llm, prompts, params))
        assert llm.engine.scheduler.num_preemptions > 0
        forked = _gen(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2))
        for out, exp in zip(forked, expected[:2]):
            assert [c.token_ids for c in out.outputs] == [exp.outputs[0].token_ids] * 2
        assert llm.engine.spec_decode_stats()["num_draft_tokens"] > 0
        assert released_everything(llm.engine)
    finally:
        llm.engine.shutdown()


def test_tp2_draft_model_speculation(ckpt_dir):
    """A draft model (run whole on rank 0, its cache layers in every rank's pool) verified by the TP-2 target:
    the greedy tokens of decoding without speculation."""
    path = make(ckpt_dir, "granitemoehybrid")
    prompts = _prompts(3, seed=7, longest=40)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _gen(LLM(path, cache_memory="16MiB", enable_progress_bar=False), prompts, params)
    spec = {"model": make(ckpt_dir, "bamba"), "num_speculative_tokens": 3}
    llm = LLM(path, tensor_parallel_size=2, cache_memory="16MiB", enable_progress_bar=False, speculative_config=spec)
    try:
        _assert_same(expected, _gen(llm, prompts, params))
        assert llm.engine.spec_decode_stats()["num_draft_tokens"] > 0
        assert released_everything(llm.engine)
    finally:
        llm.engine.shutdown()


def test_tp2_mtp_speculation(ckpt_dir, monkeypatch):
    """An MTP head (run whole on rank 0 with whole copies of the embedding and LM head, its KV layer in every
    rank's pool) over the TP-2 target's hidden states: the greedy tokens and logprobs of TP 1 without
    speculation, and TP 1's drafts (each one, and the same accepted counts as TP 1 with MTP)."""
    from hybridserve.spec_decode.mtp import MTPDrafter

    drafts: dict[int, list] = {}  # id(drafter) -> (tokens so far, drafts) after each step, in order
    after_step = MTPDrafter.after_step

    def recording(self, logits, *args):
        after_step(self, logits, *args)
        drafts.setdefault(id(self), []).extend(
            (item.seq.num_tokens, list(item.seq.spec.mtp_drafts)) for item in logits.order
            if item.seq.spec is not None and item.seq.spec.mtp_drafts)

    monkeypatch.setattr(MTPDrafter, "after_step", recording)
    path = add_mtp_weights(make(ckpt_dir, "qwen3_next"), num_layers=1, seed=4)
    prompts = _prompts(3, seed=7, longest=40)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "acceptance_floor": 0.0, "disable_by_batch_size": 8}
    opts = dict(cache_memory="16MiB", enable_progress_bar=False)
    expected = _gen(LLM(path, **opts), prompts, params)
    tp1 = LLM(path, speculative_config=spec, **opts)
    _assert_same(expected, _gen(tp1, prompts, params))
    llm = LLM(path, tensor_parallel_size=2, speculative_config=spec, **opts)
    try:
        _assert_same(expected, _gen(llm, prompts, params))
        stats, ref = llm.engine.spec_decode_stats(), tp1.engine.spec_decode_stats()
        assert stats["num_draft_tokens"] > 0
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_length_counts"):
            assert stats[key] == ref[key], key
        ours, theirs = drafts[id(llm.engine.speculator.mtp)], drafts[id(tp1.engine.speculator.mtp)]
        assert ours == theirs and len(ours) >= stats["num_drafts"]
        head = llm.engine.mtp_head
        vocab = head.hf_config.vocab_size  # whole, not the target's slices
        assert head.embed_tokens.weight.shape[0] == vocab
        assert head.compute_logits(torch.zeros(1, head.hf_config.hidden_size)).shape == (1, vocab)
        plan = plan_cache(load_hf_config(path), PlanConfig(tensor_parallel_size=2, cache_memory="16MiB",
                                                           speculative_config=spec)).summary()
        layout = llm.cache_layout()
        for key in ("page_bytes", "num_pages", "kv_bytes_per_token"):
            assert plan[key] == layout[key], key
        assert released_everything(llm.engine)
    finally:
        llm.engine.shutdown()


def test_dead_worker_takes_the_engine_down(ckpt_dir):
    """A worker killed between steps: the next step raises (naming the rank), quickly, and so does every later one."""
    llm = LLM(make(ckpt_dir, "llama"), tensor_parallel_size=2, cache_memory="16MiB", enable_progress_bar=False)
    try:
        _gen(llm, _prompts(1))
        worker = llm.engine.tp.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            _gen(llm, _prompts(2))
        assert time.monotonic() - start < 30
        with pytest.raises(TensorParallelError, match="down"):
            _gen(llm, _prompts(1))
    finally:
        llm.engine.shutdown()


def test_tp4_replicates_kv_heads_and_mamba_groups(ckpt_dir):
    """4 ranks on Bamba (2 KV heads, 2 Mamba2 groups): each KV head and each group on 2 ranks, the gated norm's
    sums of squares summed within each group's pair of ranks."""
    path = make(ckpt_dir, "bamba")
    prompts = _prompts(3, longest=40)
    expected = _gen(LLM(path, cache_memory="16MiB", enable_progress_bar=False), prompts)
    llm = LLM(path, tensor_parallel_size=4, cache_memory="16MiB", enable_progress_bar=False)
    try:
        _assert_same(expected, _gen(llm, prompts))
    finally:
        llm.engine.shutdown()


def test_worker_error_is_raised_by_rank0(ckpt_dir):
    """A worker that raises leaves its traceback for rank 0, which raises it at the next step."""
    llm = LLM(make(ckpt_dir, "llama"), tensor_parallel_size=2, cache_memory="16MiB", enable_progress_bar=False)
    try:
        llm.engine.tp.group.post(("no such command",))  # the worker raises on it and exits
        llm.engine.tp.processes[0].join(30)
        with pytest.raises(TensorParallelError, match="unknown tensor-parallel command 'no such command'"):
            _gen(llm, _prompts(1))
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("family, overrides, message", [
    ("qwen3_5", {}, "linear_num_key_heads=3 is not divisible by tensor_parallel_size=2"),
    ("llama", {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 48, "intermediate_size": 96},
     None),
    ("llama", {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48},
     "num_attention_heads=3 is not divisible by tensor_parallel_size=2"),
    ("mamba2", {"num_heads": 6, "head_dim": 16, "hidden_size": 48, "n_groups": 3},
     "mamba n_groups=3 neither divides nor is divisible by tensor_parallel_size=2"),
])
def test_head_counts_checked_before_any_worker_starts(ckpt_dir, family, overrides, message):
    """Counts that cannot be split are refused at once, naming them; fewer KV heads than ranks replicate."""
    from hybridserve.cache.spec import CacheDtypes
    from hybridserve.config import EngineConfig
    from hybridserve.distributed.sharding import check_shardable

    path = make(ckpt_dir, family, **overrides)
    hf = load_hf_config(path)
    dtypes = CacheDtypes.from_resolved(EngineConfig(model=path).resolve_dtypes(hf))
    if message is None:
        check_shardable(hf, dtypes, 2)  # 1 KV head on 2 ranks: replicated
        return
    with pytest.raises(ValueError, match=message):
        LLM(path, tensor_parallel_size=2, enable_progress_bar=False)


def test_kv_head_replication_matches_tp1(ckpt_dir):
    """One KV head shared by two query heads on 2 ranks: each rank keeps a copy of it (prompt logprobs too)."""
    path = make(ckpt_dir, "llama", num_attention_heads=2, num_key_value_heads=1, hidden_size=48)
    prompts = _prompts(2, longest=30)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    expected = _gen(LLM(path, cache_memory="16MiB", enable_progress_bar=False), prompts, params)
    llm = LLM(path, tensor_parallel_size=2, cache_memory="16MiB", enable_progress_bar=False)
    try:
        got = _gen(llm, prompts, params)
        _assert_same(expected, got)
        for a, b in zip(expected, got):  # prompt logprobs: the logits of every prompt row, gathered
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        layout = llm.cache_layout()
        assert layout["layers"][0]["tensors"][0]["shape"] == [1, 24] and layout["tensor_parallel_size"] == 2
    finally:
        llm.engine.shutdown()


def test_unsupported_family_and_options_refused(ckpt_dir, monkeypatch):
    """A family whose layers are not sharded (every built-in one is; a newly registered one until it opts in)
    is refused by name, before any worker starts; so are options tensor parallelism does not run with."""
    import dataclasses

    from hybridserve.models import registry

    path = make(ckpt_dir, "mamba")
    monkeypatch.setitem(registry._MODELS, "MambaForCausalLM",
                        dataclasses.replace(registry.family("MambaForCausalLM"), tensor_parallel=False))
    with pytest.raises(ValueError, match="tensor parallel is not supported for MambaForCausalLM yet"):
        LLM(path, tensor_parallel_size=2, enable_progress_bar=False)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be a positive integer"):
        LLM(path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="has no multi-token-prediction"):  # MTP runs under TP, on its families
        LLM(make(ckpt_dir, "llama"), tensor_parallel_size=2, speculative_config={"method": "mtp"},
            enable_progress_bar=False)


def test_plan_and_env_commands(ckpt_dir, capsys):
    """``plan --tensor-parallel-size 2`` shows one rank's figures; ``env`` says why decode runs eagerly."""
    from hybridserve.entrypoints.cli import main

    path = make(ckpt_dir, "bamba")
    assert main(["plan", path, "--tensor-parallel-size", "2", "--cache-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 2 ranks" in out and "(1, 16)" in out and "per rank" in out
    assert main(["plan", make(ckpt_dir, "qwen3_5"), "-tp", "2"]) == 2
    assert "linear_num_key_heads=3 is not divisible by tensor_parallel_size=2" in capsys.readouterr().err
    assert main(["env", "--model", path, "--tensor-parallel-size", "2", "--json"]) == 0
    assert "tensor parallel (tensor_parallel_size=2)" in capsys.readouterr().out


LAUNCHED = """
import os, sys
sys.path.insert(0, {root!r})
from hybridserve import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM({path!r}, tensor_parallel_size=2, cache_memory="16MiB", enable_progress_bar=False)
    params = SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate([{{"prompt_token_ids": {prompt!r}}}], params, use_tqdm=False)
    print("tokens", out[0].outputs[0].token_ids, flush=True)
    llm.engine.shutdown()
"""


def test_torchrun_style_launch(ckpt_dir, tmp_path):
    """Two processes started with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun starts them): rank 0
    generates TP 1's tokens, rank 1 serves it and exits cleanly when it stops."""
    import socket
    import subprocess
    import sys

    path = make(ckpt_dir, "bamba")
    prompt = list(range(3, 30))
    expected = LLM(path, cache_memory="16MiB", enable_progress_bar=False).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    script = tmp_path / "launched.py"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script.write_text(LAUNCHED.format(root=root, path=path, prompt=prompt))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert f"tokens {expected[0].outputs[0].token_ids}" in outs[0]


@pytest.mark.parametrize("conv", ["auto", "int8"])
def test_tp2_with_8_bit_state_matches_tp1(ckpt_dir, conv, family="bamba"):
    """int8 temporal state on 2 ranks: each rank rounds its heads' codes as one rank does (the noise numbered
    from its slice's start), and the prefix cache's snapshot copies (codes and scales) replay on rank 1; with an
    int8 conv state too (a channel's codes and exponent depend on that channel alone)."""
    path = make(ckpt_dir, family)
    prompts = [list(range(3, 40))] + _prompts(2, longest=40)
    opts = dict(cache_memory="16MiB", max_num_batched_tokens=16, enable_progress_bar=False,
                mamba_ssm_cache_dtype="int8", mamba_cache_dtype=conv)
    tp1 = LLM(path, **opts)
    expected = _gen(tp1, prompts)
    turn2 = [prompts[0] + expected[0].outputs[0].token_ids + [5, 6]]
    expected2 = _gen(tp1, turn2)
    llm = LLM(path, tensor_parallel_size=2, **opts)
    try:
        _assert_same(expected, _gen(llm, prompts))
        _assert_same(expected2, _gen(llm, turn2))
        assert llm.engine.prefix_cache_stats()["hits"] > 0
        assert llm.cache_layout()["mamba_ssm_cache_dtype"] == "int8"
        assert llm.cache_layout()["mamba_cache_dtype"] == ("int8" if conv == "int8" else "float32")
        assert released_everything(llm.engine)
    finally:
        llm.engine.shutdown()
