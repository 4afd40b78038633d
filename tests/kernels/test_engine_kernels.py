"""The compiled CPU kernels in the engine: greedy generation with ``cpu_kernels=True`` equals the
plain-PyTorch run (``cpu_kernels=False``) token for token, with logprobs within rounding noise, for
hybrid families in float32 and bfloat16, with mixed cache dtypes, and with an fp8 KV cache (which the
attention kernels decline); the kernels really run (or really do not); the option is validated and
has a CLI flag."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import attention, gemm, pointwise, recurrent
from tests.checkpoints import make
from tests.kernels.helpers import needs_compiler
from tests.layers.test_int8_weights import compare_near_tie
from tests.prefix_utils import released_everything

PROMPT_LENGTHS = (1, 7, 19, 33)  # with a 24-token budget: chunked prefill, prefill and decode in one step
PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
LOGPROB_TOL = {"float32": 1e-4}


def bf16_logprob_tolerance(max_abs_logit: float) -> float:
    """Two bf16 ulps at the run's largest |logit|: each path rounds a logit to bf16 once, so the two
    roundings of one value are at most one ulp apart, and the float32 logsumexp moves by at most as much."""
    return 2.0 * 2.0 ** (math.floor(math.log2(max_abs_logit)) - 7)

KERNELS = {recurrent: ("causal_conv1d", "mamba2_scan"), attention: ("kv_write", "paged_attention"),
           pointwise: ("rms_norm", "gated_rms_norm", "silu_mul"), gemm: ("linear",)}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts, per kernel entry point, the calls it covered (did not decline)."""
    counts = {name: 0 for names in KERNELS.values() for name in names}
    for module, names in KERNELS.items():
        for name in names:
            real = getattr(module, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                result = _real(*args, **kwargs)
                if result is not None and result is not False:
                    counts[_name] += 1
                return result

            monkeypatch.setattr(module, name, counted)
    return counts


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _generate(path, cpu_kernels, **options):
    return _generate_with_logits_range(path, cpu_kernels, **options)[0]


def _generate_with_logits_range(path, cpu_kernels, params=PARAMS, **options):
    """The completions, and the largest |logit| the LM head gave (with the kernels off: it is a module)."""
    llm = LLM(path, cpu_kernels=cpu_kernels, cache_memory="16MiB", max_num_batched_tokens=24, max_num_seqs=3,
              enable_progress_bar=False, **options)
    assert llm.engine.cpu_kernels is cpu_kernels
    largest = [0.0]
    hook = llm.engine.model.lm_head.register_forward_hook(
        lambda module, args, out: largest.__setitem__(0, max(largest[0], out.detach().abs().max().item())))
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    hook.remove()
    assert released_everything(llm.engine)
    return [o.outputs[0] for o in outs], largest[0]


def _assert_same_generation(with_kernels, without, tol):
    for i, (a, b) in enumerate(zip(with_kernels, without)):
        assert a.token_ids == b.token_ids, f"prompt {i}: tokens differ"
        assert len(a.logprobs) == len(b.logprobs) == PARAMS.max_tokens
        for step, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            for tid, lp in lb.items():
                assert tid in la, f"prompt {i} step {step}: token {tid} not among the kernels' top logprobs"
                assert abs(la[tid].logprob - lp.logprob) <= tol, (i, step, tid, la[tid].logprob, lp.logprob)


# Hybrid Mamba2 + attention families whose layers use every kernel: conv and scan, KV write and
# paged attention, RMS norms (Granite and Falcon-H1: with residual multipliers), the gated group norm,
# silu * up (Granite: in its shared MLP) and the linear layers.
FAMILIES = ["bamba", "granitemoehybrid", "falcon_h1"]
ALL_KERNELS = {name for names in KERNELS.values() for name in names}


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_match_pytorch_paths(ckpt_dir, kernel_calls, family, dtype):
    path = make(ckpt_dir, family)
    with_kernels = _generate(path, True, dtype=dtype)
    used = {name for name, n in kernel_calls.items() if n > 0}
    expected = ALL_KERNELS if gemm.available() else ALL_KERNELS - {"linear"}
    assert used == expected, f"kernels that never ran: {expected - used}, ran: {used}"
    kernel_calls.update({name: 0 for name in kernel_calls})
    without, largest = _generate_with_logits_range(path, False, dtype=dtype)
    assert not any(kernel_calls.values()), f"kernels ran with cpu_kernels=False: {kernel_calls}"
    _assert_same_generation(with_kernels, without,
                            bf16_logprob_tolerance(largest) if dtype == "bfloat16" else LOGPROB_TOL[dtype])


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mamba2_gate_without_norm_runs_on_its_kernel(ckpt_dir, monkeypatch, dtype):
    """Falcon-H1 at its config defaults (``mamba_rms_norm=False``: ``y * silu(gate)``, no gated norm): the gate
    runs on ``silu_gate`` and the generation equals the plain-PyTorch run."""
    calls = {"silu_gate": 0}
    real = pointwise.silu_gate

    def counted(*args):
        out = real(*args)
        calls["silu_gate"] += out is not None
        return out

    monkeypatch.setattr(pointwise, "silu_gate", counted)
    path = make(ckpt_dir, "falcon_h1_defaults")
    with_kernels = _generate(path, True, dtype=dtype)
    assert calls["silu_gate"] > 0
    without, largest = _generate_with_logits_range(path, False, dtype=dtype)
    _assert_same_generation(with_kernels, without,
                            bf16_logprob_tolerance(largest) if dtype == "bfloat16" else LOGPROB_TOL[dtype])


@needs_compiler
def test_kernels_with_mixed_cache_dtypes(ckpt_dir, kernel_calls):
    """bf16 activations with float32 SSM state, float16 conv state and float16 KV: each kernel works in
    its cache's own dtype."""
    path = make(ckpt_dir, "granitemoehybrid")
    opts = dict(dtype="bfloat16", mamba_ssm_cache_dtype="float32", mamba_cache_dtype="float16",
                kv_cache_dtype="float16")
    with_kernels = _generate(path, True, **opts)
    assert kernel_calls["mamba2_scan"] > 0 and kernel_calls["paged_attention"] > 0
    without, largest = _generate_with_logits_range(path, False, **opts)
    _assert_same_generation(with_kernels, without, bf16_logprob_tolerance(largest))


@needs_compiler
def test_fp8_kv_cache_falls_back_for_attention_only(ckpt_dir, kernel_calls):
    path = make(ckpt_dir, "bamba")
    with_kernels = _generate(path, True, kv_cache_dtype="fp8_e4m3")
    assert kernel_calls["kv_write"] == 0 and kernel_calls["paged_attention"] == 0  # declined: PyTorch path
    assert kernel_calls["mamba2_scan"] > 0 and kernel_calls["rms_norm"] > 0  # the others still run
    _assert_same_generation(with_kernels, _generate(path, False, kv_cache_dtype="fp8_e4m3"), LOGPROB_TOL["float32"])


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cpu_kernels_option_is_validated(value):
    with pytest.raises(ValueError) as err:
        EngineConfig(model="x", cpu_kernels=value)
    assert "cpu_kernels" in str(err.value) and repr(value) in str(err.value)


def test_cpu_kernels_default_and_cli_flag():
    assert EngineConfig(model="x").cpu_kernels is True
    parser = build_parser()
    for command in (["generate", "some/dir"], ["serve", "some/dir"]):  # the commands that run an engine
        assert parser.parse_args(command).cpu_kernels is True
        args = parser.parse_args([*command, "--no-cpu-kernels"])
        assert args.cpu_kernels is False
        kwargs = engine_kwargs(args)
        assert kwargs["cpu_kernels"] is False
        assert EngineConfig(**{**kwargs, "model": "x"}).cpu_kernels is False


ALL_FAMILIES = ["mamba", "falcon_mamba", "jamba", "qwen3_next", "minimax", "lfm2", "lfm2_moe", "lfm3", "zamba2",
                "falcon_h1", "granitemoehybrid", "granitemoehybrid_dense", "nemotron_h", "nemotron_h_latent", "bamba",
                "llama", "mamba2", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "xlstm", "kimi_linear"]


#: the every-family test's sampling: top-5 logprobs, for the near-tie rule
PARAMS_TOP5 = SamplingParams(temperature=0, max_tokens=PARAMS.max_tokens, logprobs=5, ignore_eos=True)


def _mean_logprob_errors(runs, reference):
    """Per run, the mean |logprob - reference logprob| over the top tokens both report, on the same steps
    for every run: each prompt's steps up to the first where any run's greedy token differs from the
    reference's (that step's context is still shared; later ones are not)."""
    errors = [[] for _ in runs]
    for i, ref in enumerate(reference):
        shared = min(next((s + 1 for s, (a, b) in enumerate(zip(run[i].token_ids, ref.token_ids)) if a != b),
                          len(ref.token_ids)) for run in runs)
        for errs, run in zip(errors, runs):
            for la, lb in zip(run[i].logprobs[:shared], ref.logprobs[:shared]):
                errs += [abs(la[t].logprob - lp.logprob) for t, lp in lb.items() if t in la]
    assert all(errors), "no step to compare with the reference"
    return [sum(errs) / len(errs) for errs in errors]


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_bf16_linear_kernel_in_every_family(ckpt_dir, kernel_calls, family):
    """Every family in bf16 runs its linear layers (MoE experts, shared blocks, adapters, untied heads
    included) through the kernel: the greedy tokens of the bf16 run without the kernels up to the
    near-tie rule, and logprobs as close to the float32 run as that run's are, on the same steps (bf16
    rounding noise differs in where it falls, not in size: on Jamba's MoE the two bf16 runs differ by up
    to 0.07 while each is up to 0.13 from float32).

    The two bf16 runs are two numerical paths: the kernel's float32 sums and oneDNN's (on AMX, in
    another order again) round a logit to bf16 differently, so at a near tie they may take different
    tokens (Zamba2, prompt 1, step 5 on an AMX CPU: the kernel's top two 0.03 apart, torch's 0.06 apart
    the other way, float32's 0.017). ``compare_near_tie`` accepts a divergence only where the torch
    run's top two are less than 0.3 (a few bf16 ulps of these logits) apart and each run's token is in
    the other's top 5, and stops comparing that prompt there."""
    from hybridserve.layers.moe import FusedExperts
    from hybridserve.layers.packed_linear import KernelLinear

    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    llm = LLM(path, cpu_kernels=True, cache_memory="16MiB", max_num_batched_tokens=24, max_num_seqs=3,
              enable_progress_bar=False, dtype="bfloat16")
    assert any(isinstance(m, KernelLinear) for m in llm.engine.model.modules())
    # no 16-bit linear left on torch's matmul (a scalar path on CPUs without AVX-512), experts included
    assert llm.engine.cpu_fast_paths.torch_16bit_linears == 0
    assert all(m.packed is not None for m in llm.engine.model.modules() if isinstance(m, FusedExperts))
    with_kernels = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], PARAMS_TOP5)]
    assert kernel_calls["linear"] > 0
    without = _generate(path, False, params=PARAMS_TOP5, dtype="bfloat16")
    _, steps = compare_near_tie(with_kernels, without)
    assert steps > 0
    exact = _generate(path, False, params=PARAMS_TOP5, dtype="float32")
    kernel_error, torch_error = _mean_logprob_errors([with_kernels, without], exact)
    assert kernel_error <= 1.25 * torch_error + 1e-3, (kernel_error, torch_error)
