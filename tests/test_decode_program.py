"""The decode program (``hybridserve/kernels/program.py``): decode steps as one C++ call.

It must be bit-identical to the module path it replaces (same kernels, same arguments): greedy and
seeded sampling give the same tokens and the very same logprobs with the program on and off, across
steps whose batch size changes, mixed prefill/decode steps (which keep the module path) and mixed
cache dtypes. Models, layers and settings it does not cover keep the module path; bad step input
raises instead of running."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import gemm, program
from tests.checkpoints import make
from tests.kernels.helpers import needs_compiler

needs_bf16_kernel = pytest.mark.skipif(not gemm.available(),
                                       reason="the linear kernels did not build: no program")

# Lengths and budgets such that steps mix prefill chunks with decodes, sequences finish at different
# steps (so decode-only steps shrink), and a late request joins while others decode.
PROMPT_LENGTHS = (3, 11, 25, 6)
MAX_TOKENS = (12, 7, 16, 9)


def _llm(path, decode_program, **options):
    return LLM(path, dtype="bfloat16", cpu_decode_program=decode_program, cache_memory="16MiB",
               max_num_batched_tokens=24, max_num_seqs=3, enable_progress_bar=False, **options)


def _run(path, decode_program, params_of, monkeypatch=None, **options):
    """Outputs of the four prompts, and how many steps ran through the program (when counted)."""
    llm = _llm(path, decode_program, **options)
    runs = {"program": 0}
    if monkeypatch is not None and llm.engine.runner.decode_program is not None:
        real = llm.engine.runner.decode_program.run

        def counted(*args, **kwargs):
            runs["program"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(llm.engine.runner.decode_program, "run", counted)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 128, (n,), generator=g).tolist()} for n in PROMPT_LENGTHS]
    outs = llm.generate(prompts, [params_of(i) for i in range(len(prompts))])
    assert llm.engine.pool.used_bytes() == 0
    return [o.outputs[0] for o in outs], runs["program"], llm


def _assert_identical(a_outs, b_outs):
    for i, (a, b) in enumerate(zip(a_outs, b_outs)):
        assert a.token_ids == b.token_ids, f"prompt {i}: tokens differ"
        assert a.cumulative_logprob == b.cumulative_logprob, f"prompt {i}: cumulative logprob differs"
        for step, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            assert {t: (lp.logprob, lp.rank) for t, lp in la.items()} == \
                   {t: (lp.logprob, lp.rank) for t, lp in lb.items()}, f"prompt {i} step {step}"


CACHE_SETTINGS = {
    "model dtypes": {},
    "f32 ssm, f16 conv, f16 kv": dict(mamba_ssm_cache_dtype="float32", mamba_cache_dtype="float16",
                                      kv_cache_dtype="float16"),
    "f32 kv and states": dict(mamba_ssm_cache_dtype="float32", mamba_cache_dtype="float32",
                              kv_cache_dtype="float32"),
}


# Granite-4.0-H dense: NoPE, embedding multiplier 3, residual multiplier 0.7, two SSM groups; with
# RoPE; Bamba: RoPE over half of each head (partial rotary), separate gate and up projections.
MODELS = {"granite": ("granitemoehybrid_dense", {}),
          "granite rope": ("granitemoehybrid_dense", {"position_embedding_type": "rope"}),
          "bamba partial rope": ("bamba", {"partial_rotary_factor": 0.5})}


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("setting", list(CACHE_SETTINGS))
def test_program_is_bit_identical_to_modules(ckpt_dir, monkeypatch, setting, model):
    family, overrides = MODELS[model]
    path = make(ckpt_dir, family, dtype=torch.bfloat16, **overrides)
    opts = CACHE_SETTINGS[setting]

    def greedy(i):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], logprobs=4, ignore_eos=True)

    with_program, runs, llm = _run(path, True, greedy, monkeypatch, **opts)
    assert llm.engine.runner.decode_program is not None
    assert runs >= 8, f"only {runs} steps went through the program"
    without, _, llm_off = _run(path, False, greedy, **opts)
    assert llm_off.engine.runner.decode_program is None
    _assert_identical(with_program, without)


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("model", list(MODELS))
def test_program_against_hf(ckpt_dir, monkeypatch, model):
    """bf16 model with float32 SSM state, decode steps through the program, against HF transformers in
    float32 on the same weights: any divergence is a near-tie (``compare``), and the logprob error is
    no larger than that of the plain-PyTorch bf16 run (``cpu_kernels=False``) on the same checkpoint."""
    from tests.hf_reference import compare, hf_greedy

    family, overrides = MODELS[model]
    path32 = make(ckpt_dir, family, **overrides)
    path16 = make(ckpt_dir, family, dtype=torch.bfloat16, **overrides)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 11, 25)]
    ref = hf_greedy(path32, prompts, 12)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    errors = {}
    for name, options in (("program", {}), ("torch", {"cpu_kernels": False})):
        llm = LLM(path16, dtype="bfloat16", mamba_ssm_cache_dtype="float32", cache_memory="16MiB",
                  enable_progress_bar=False, **options)
        runs = {"program": 0}
        if llm.engine.runner.decode_program is not None:
            real = llm.engine.runner.decode_program.run
            monkeypatch.setattr(llm.engine.runner.decode_program, "run",
                                lambda *a, _real=real, _runs=runs, **k: _runs.update(program=_runs["program"] + 1)
                                or _real(*a, **k))
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert (runs["program"] > 0) == (name == "program")
        cmp = compare([o.token_ids for o in outs], [o.logprobs for o in outs], ref)
        assert cmp.compared_tokens >= 6, (name, cmp.diverged_at)
        errors[name] = cmp.mean_abs_error
    assert errors["program"] <= 1.25 * errors["torch"] + 1e-3, errors


@needs_compiler
@needs_bf16_kernel
def test_program_with_seeded_sampling(ckpt_dir):
    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)

    def sampled(i):
        return SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS[i], logprobs=2,
                              ignore_eos=True)

    _assert_identical(_run(path, True, sampled)[0], _run(path, False, sampled)[0])


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("family, dtype, options, reason", [
    ("granitemoehybrid", torch.bfloat16, {}, "experts"),
    ("nemotron_h", torch.bfloat16, {}, "has no decode program"),
    ("granitemoehybrid_dense", torch.bfloat16, {"kv_cache_dtype": "fp8_e4m3"}, "KV cache"),
    ("granitemoehybrid_dense", torch.float32, {}, "float32 Linear layers have no decode-program kernel"),
])
def test_uncovered_models_keep_the_module_path(ckpt_dir, caplog, family, dtype, options, reason):
    path = make(ckpt_dir, family, dtype=dtype)
    with caplog.at_level("WARNING", logger="hybridserve.engine.cpu_fast_paths"):
        llm = LLM(path, cpu_decode_program=True, cache_memory="16MiB", max_num_seqs=3, enable_progress_bar=False,
                  **options)
    assert llm.engine.runner.decode_program is None
    assert reason in llm.engine.cpu_fast_paths.decode_reason
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and reason in warnings[0].getMessage(), caplog.text  # one line, the real reason
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


@needs_compiler
@needs_bf16_kernel
def test_program_off_with_kernels_off(ckpt_dir):
    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    assert LLM(path, cpu_kernels=False, cache_memory="16MiB", enable_progress_bar=False
               ).engine.runner.decode_program is None


@needs_compiler
@needs_bf16_kernel
def test_program_keeps_what_it_points_into_alive(ckpt_dir):
    """A program outliving its engine still owns every tensor its calls point into (weights, packed
    weights, the cache pool): none is freed under it."""
    import gc
    import weakref

    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    llm = _llm(path, True)
    model = llm.engine.model
    tensors = [model.model.norm.weight, model.model.layers[0].input_layernorm.weight,
               model.model.layers[0].mamba.in_proj.packed_weight, model.model.layers[0].mamba.norm.weight,
               llm.engine.pool.layer_caches[0].state["ssm"], llm.engine.pool.layer_caches[2].k]
    refs = [weakref.ref(t) for t in tensors]
    prog = llm.engine.runner.decode_program
    del llm, model, tensors
    gc.collect()
    assert all(r() is not None for r in refs)
    assert prog.run(torch.tensor([5, 6]), torch.arange(3), torch.arange(2), torch.ones(2, dtype=torch.int64),
                    torch.zeros(2, 1, dtype=torch.int64), torch.arange(2)).shape == (2, 64)


@needs_compiler
@needs_bf16_kernel
def test_run_rejects_bad_step_input(ckpt_dir):
    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    prog = _llm(path, True).engine.runner.decode_program
    assert prog is not None and prog.max_rows == 3

    def step(rows, ids=None, index_dtype=torch.int64):
        ids = torch.full((rows,), 5, dtype=torch.int64) if ids is None else ids
        lens = torch.full((rows,), 1, dtype=index_dtype)
        tables = torch.zeros(rows, 1, dtype=torch.int64)
        return prog.run(ids, torch.arange(rows + 1), torch.arange(rows), lens, tables, torch.arange(rows))

    with pytest.raises(ValueError, match="1 to 3 sequences, got 4"):
        step(4)
    with pytest.raises(ValueError, match="1 to 3 sequences, got 0"):
        step(0)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous int64"):
        step(2, index_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="op 0 of .* failed"):  # the embedding checks token ids
        step(2, ids=torch.tensor([5, 128]))
    assert step(2).shape == (2, 64)


@needs_compiler
def test_builder_checks_calls():
    if not program.available():
        pytest.skip("no compiled kernels")
    b = program.ProgramBuilder(4)
    with pytest.raises(ValueError, match="takes 9 arguments, got 2"):
        b.call("hs_linear_bf16", [1, 2])
    with pytest.raises(ValueError, match="not a program kernel"):
        b.call("hs_nonexistent", [])
    with pytest.raises(program.Unsupported, match="contiguous rows"):
        b.rows(torch.zeros(4, 6)[:, ::2])


@needs_compiler
def test_malformed_program_is_refused():
    if not program.available():
        pytest.skip("no compiled kernels")
    out = torch.zeros(2, 4)
    # unknown kernel, unknown op, truncated, a kernel given too few arguments, an embedding given one
    for code in ([2, 1, 0, 99], [7, 1, 0, 0], [2, 5, 0, 0], [2, 2, 0, 1, 0, 5], [1, 1, 0, 1]):
        prog = program.Program(code, 1, [], out, 2)
        with pytest.raises(RuntimeError, match="failed \\(code 91\\)"):
            prog.run(torch.tensor([0]), torch.arange(2), None, None, None, None)


@pytest.mark.parametrize("value", ["no", 0])
def test_option_is_validated(value):
    with pytest.raises(ValueError, match="cpu_decode_program"):
        EngineConfig(model="x", cpu_decode_program=value)


def test_default_and_cli_flag():
    assert EngineConfig(model="x").cpu_decode_program is True
    parser = build_parser()
    for command in (["generate", "d"], ["serve", "d"]):
        assert engine_kwargs(parser.parse_args(command))["cpu_decode_program"] is True
        assert engine_kwargs(parser.parse_args([*command, "--no-cpu-decode-program"]))["cpu_decode_program"] is False


def test_fingerprint_ignores_the_option():
    assert EngineConfig(model="x").fingerprint() == EngineConfig(model="x", cpu_decode_program=False).fingerprint()
