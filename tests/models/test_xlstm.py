"""xLSTM: the mLSTM CPU kernel against the PyTorch ops and path, the fused weight layout, a pool that holds
fewer sequences than are asked for, and the reason a biased model's decode is not captured. The cell's own
checks (the chunkwise prefill ends in the stepped state, HF's native kernels, the decode update, the stored
max state) are tests/ops/test_mlstm.py's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from hybridserve.kernels import recurrent
from hybridserve.ops.mlstm import fit_max_state, mlstm_varlen_ref
from tests.checkpoints import make
from tests.engine.test_parity import prompts
from tests.hf_reference import compare, hf_greedy
from tests.kernels.helpers import needs_compiler
from tests.ops.test_mlstm import _assert_close_rel, _cu, _initial, _inputs, _pool
from tests.prefix_utils import released_everything


@needs_compiler
@pytest.mark.parametrize("act_dtype, state_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32)])
def test_kernel_matches_ops(act_dtype, state_dtype):
    """The mLSTM kernel (soft caps, cell, multi-head norm, output gate) against the PyTorch ops on a varlen group
    from given states, states included."""
    from hybridserve.layers.mlstm import MultiHeadLayerNorm
    from hybridserve.ops.mlstm import soft_cap

    if not recurrent.available():
        pytest.skip("the recurrent kernels did not build")
    H, Dk, Dv, lens, cap = 3, 8, 16, [1, 5, 12], 6.0
    T, S = sum(lens), len(lens)
    q, k, v, i, f = (t.to(act_dtype) for t in _inputs(T, H, Dk, Dv, seed=8))
    o = torch.randn(T, H * Dv).to(act_dtype)
    norm = MultiHeadLayerNorm(H, Dv, 1e-6, bias=True)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2), norm.bias.normal_(0.0, 0.2)
    norm = norm.to(act_dtype)
    init = fit_max_state(*_initial(S, H, Dk, Dv, seed=9), state_dtype)
    states = tuple(s.to(state_dtype) for s in init)
    slots = torch.tensor([2, 0, 1])
    pool, _ = _pool(3, H, Dk, Dv, state_dtype)
    for p, s in zip(pool, states):
        p[slots] = s
    y = torch.empty(T, H * Dv, dtype=act_dtype)
    assert recurrent.mlstm(pool, q.flatten(1), k.flatten(1), v.flatten(1), o, i, f, cap, norm.weight, norm.bias,
                           norm.eps, 1e-6, _cu(lens), slots, y)  # raw gates: the kernel soft-caps them
    h, final = mlstm_varlen_ref(q, k, v, soft_cap(i, cap).float(), soft_cap(f, cap).float(), _cu(lens),
                                tuple(s.float() for s in states))
    with torch.no_grad():
        y_ref = torch.sigmoid(o) * norm(h.to(act_dtype))
    tol = 1e-5 if act_dtype == torch.float32 else 2e-2
    _assert_close_rel(y.float(), y_ref.float(), tol)
    final = fit_max_state(*final, state_dtype)
    for p, ref in zip(pool, final):
        _assert_close_rel(p[slots].float(), ref.to(state_dtype).float(),
                          1e-5 if state_dtype == torch.float32 and act_dtype == torch.float32 else 2e-2)


def _generate(path, **options):
    llm = LLM(path, max_num_batched_tokens=20, max_num_seqs=3, cache_memory="16MiB", enable_progress_bar=False,
              **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(128)],
                        SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True))
    assert released_everything(llm.engine)
    return [o.outputs[0] for o in outs], llm


def _assert_same(a_outs, b_outs, tol):
    for n, (a, b) in enumerate(zip(a_outs, b_outs)):
        assert a.token_ids == b.token_ids, f"prompt {n}: tokens differ"
        for step, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            for tid, lp in lb.items():
                assert abs(la[tid].logprob - lp.logprob) <= tol, (n, step, tid)


@needs_compiler
def test_engine_kernel_path_matches_pytorch_path(ckpt_dir, monkeypatch):
    """float32: the same tokens, logprobs within 1e-4 (bf16, where a logit's last bit may differ, is
    tests/kernels/test_engine_kernels.py's: the same tokens, logprobs as close to float32 as PyTorch's)."""
    if not recurrent.available():
        pytest.skip("the recurrent kernels did not build")
    calls = {"mlstm": 0}
    real = recurrent.mlstm

    def counted(*args, **kwargs):
        done = real(*args, **kwargs)
        calls["mlstm"] += int(done)
        return done

    monkeypatch.setattr(recurrent, "mlstm", counted)
    path = make(ckpt_dir, "xlstm")
    with_kernels, _ = _generate(path, cpu_kernels=True)
    assert calls["mlstm"] > 0
    calls["mlstm"] = 0
    without, _ = _generate(path, cpu_kernels=False)
    assert calls["mlstm"] == 0
    _assert_same(with_kernels, without, 1e-4)


def _fused_copy(src: str, dst: str) -> str:
    """The checkpoint at ``src`` in ``weight_mode`` fused: q, k, v, ogate_preact stacked into qkv_opreact,
    igate / fgate into ifgate_preact, proj_up_gate / proj_up into proj_up_gate_z (HF's split order)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(dst, "config.json")) as fh:
        config = json.load(fh)
    config["weight_mode"] = "fused"
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    weights = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, w in weights.items():
        prefix, _, leaf = name.rpartition(".")
        base = prefix.rpartition(".")[0]
        if name.endswith("mlstm_layer.q.weight"):
            out[f"{base}.qkv_opreact.weight"] = torch.cat([weights[f"{base}.{p}.weight"]
                                                           for p in ("q", "k", "v", "ogate_preact")])
        elif name.endswith("mlstm_layer.igate_preact.weight") or name.endswith("mlstm_layer.igate_preact.bias"):
            out[f"{base}.ifgate_preact.{leaf}"] = torch.cat([w, weights[f"{base}.fgate_preact.{leaf}"]])
        elif name.endswith("ffn.proj_up_gate.weight"):
            out[f"{base}.proj_up_gate_z.weight"] = torch.cat([w, weights[f"{base}.proj_up.weight"]])
        elif not any(name.endswith(s) for s in ("mlstm_layer.k.weight", "mlstm_layer.v.weight",
                                                "ogate_preact.weight", "fgate_preact.weight", "fgate_preact.bias",
                                                "ffn.proj_up.weight")):
            out[name] = w
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_fused_weight_mode_matches_single(ckpt_dir, tmp_path):
    """weight_mode fused (HF cannot build it from a config: its init of ifgate_preact fails) serves the same
    model as the single projections it stacks: the same tokens and logprobs, and those match HF's."""
    single = make(ckpt_dir, "xlstm")
    fused = _fused_copy(single, str(tmp_path / "fused"))
    a, _ = _generate(single)
    b, _ = _generate(fused)
    _assert_same(b, a, 1e-5)
    refs = hf_greedy(single, prompts(128), 10)
    cmp = compare([o.token_ids for o in b], [o.logprobs for o in b], refs)
    assert cmp.compared_tokens >= 30 and cmp.max_topk_error <= 1e-3, (cmp.diverged_at, cmp.max_topk_error)


def test_few_slots_queue_requests_without_preemption(ckpt_dir):
    """A pool of two state slots and six requests: with no KV a sequence never grows, so the scheduler only
    queues (never preempts) and every request still matches HF."""
    path = make(ckpt_dir, "xlstm")
    slot = LLM(path, cache_memory="16MiB").cache_layout()["slot_bytes"]
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=6, cache_memory=2 * slot + 64)
    ps = prompts(128, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions == 0
    refs = hf_greedy(path, ps, 10)
    cmp = compare([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], refs)
    assert cmp.compared_tokens >= len(ps) * 5 and cmp.max_topk_error <= 1e-3, (cmp.diverged_at, cmp.max_topk_error)
    assert released_everything(llm.engine)


def test_biased_norms_run_eagerly_with_the_reason_named(ckpt_dir):
    """use_bias puts a bias on the RMS norms, which the norm kernels do not take: those norms run in PyTorch, the
    decode step is not captured and the reason names the operators; generation still matches HF."""
    path = make(ckpt_dir, "xlstm", dtype=torch.bfloat16, use_bias=True)
    outs, llm = _generate(path, dtype="bfloat16")
    report = llm.engine.cpu_fast_paths
    if report.kernels:
        assert not report.decode_captured and "aten." in report.decode_reason, report.decode_reason
    eager, _ = _generate(path, dtype="bfloat16", enforce_eager=True)
    _assert_same(outs, eager, 0.0)
