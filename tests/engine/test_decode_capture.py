"""Captured decode steps (``engine/decode_capture.py``): the model's forward recorded per batch-size
bucket and replayed in one C++ call.

Replay must be bit-identical to the eager forward it records: greedy and seeded sampling give the
same tokens and the very same logprobs with capture on and off (``enforce_eager``), across steps
whose batch size changes (padded to their bucket), mixed prefill/decode steps (which run eagerly) and
mixed cache dtypes. A model whose forward runs anything but kernels is not captured, with the
operators named; it still generates."""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import fallbacks, gemm
from tests.checkpoints import make
from tests.default_configs import DEFAULTS_BUILDERS
from tests.kernels.helpers import needs_compiler
from tests.prefix_utils import released_everything

needs_bf16_kernel = pytest.mark.skipif(not gemm.available(),
                                       reason="the linear kernels did not build: no capture")

# Lengths and budgets such that steps mix prefill chunks with decodes, sequences finish at different
# steps (so decode-only steps shrink), and a late request joins while others decode.
PROMPT_LENGTHS = (3, 11, 25, 6)
MAX_TOKENS = (12, 7, 16, 9)


def _llm(path, captured, dtype="bfloat16", **options):
    return LLM(path, dtype=dtype, enforce_eager=not captured, cache_memory="16MiB",
               max_num_batched_tokens=24, max_num_seqs=3, enable_progress_bar=False, **options)


def count_replays(llm, monkeypatch) -> dict:
    """A counter of the decode steps ``llm`` replays from its captures (``runs["replays"]``)."""
    runs = {"replays": 0}
    captured = llm.engine.runner.captured_decode
    if captured is not None:
        real = captured.run

        def counted(*args, **kwargs):
            runs["replays"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(captured, "run", counted)
    return runs


def _run(path, captured, params_of, monkeypatch=None, **options):
    """Outputs of the four prompts, and how many steps were replays (when counted)."""
    llm = _llm(path, captured, **options)
    runs = count_replays(llm, monkeypatch) if monkeypatch is not None else {"replays": 0}
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 128, (n,), generator=g).tolist()} for n in PROMPT_LENGTHS]
    outs = llm.generate(prompts, [params_of(i) for i in range(len(prompts))])
    assert released_everything(llm.engine)
    return [o.outputs[0] for o in outs], runs["replays"], llm


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
# RoPE; Bamba: RoPE over half of each head (partial rotary), separate gate and up projections; pure
# Mamba2; Llama (attention only); Granite-4.0-H with experts; Nemotron-H (Mamba2, attention, relu2
# MLP and MoE layers), also with its latent expert projection; Mamba, FalconMamba and Jamba (Mamba1);
# Falcon-H1; Zamba2; LFM2; MiniMax; Qwen3-Next; Qwen3.5, dense and MoE; OLMo-Hybrid, with and without RoPE and
# with value heads grouped per key head;
# xLSTM; Kimi Linear.
MODELS = {"granite": ("granitemoehybrid_dense", {}),
          "granite rope": ("granitemoehybrid_dense", {"position_embedding_type": "rope"}),
          "bamba partial rope": ("bamba", {"partial_rotary_factor": 0.5}),
          "mamba2": ("mamba2", {}),  # a float32 residual stream (residual_in_fp32) between bf16 layers
          "mamba2 bf16 stream": ("mamba2", {"residual_in_fp32": False}),
          "llama": ("llama", {}),
          "granite moe": ("granitemoehybrid", {}),  # routed experts plus the shared MLP
          "nemotron-h": ("nemotron_h", {}),  # relu2 MLP, grouped sigmoid routing, float32 norm weights
          "nemotron-h latent": ("nemotron_h_latent", {}),
          "mamba": ("mamba", {}),  # Mamba1 selective scan, float32 residual stream
          "falcon-mamba": ("falcon_mamba", {}),  # weightless dt/B/C norms
          "jamba": ("jamba", {}),  # Mamba1 with weighted dt/B/C norms, attention, softmax-routed experts
          "falcon-h1": ("falcon_h1", {}),  # attention beside Mamba2, every muP multiplier
          "falcon-h1 norm before gate": ("falcon_h1", {"mamba_norm_before_gate": True}),
          "zamba2": ("zamba2", {}),  # shared attention blocks over concat(x, embeddings), gelu MLP, adapters
          "lfm2": ("lfm2", {}),  # gated short convolutions, attention with q/k norms
          "lfm2-moe": ("lfm2_moe", {}),  # LFM2 layers, sigmoid-routed experts with an expert bias
          "lfm3": ("lfm3", {}),  # LFM2 layers, per-head gates, sandwich norms, a window page group
          "minimax": ("minimax", {}),  # lightning (decayed linear) attention, sliding-window attention, MoE
          "qwen3-next": ("qwen3_next", {}),  # gated delta net, gated attention with q/k norms, shared expert
          "qwen3.5": ("qwen3_5", {}),  # Qwen3-Next's layers (separate projections reordered), dense MLP
          "qwen3.5-moe": ("qwen3_5_moe", {}),  # ... and an always-renormalized MoE on every layer
          "olmo-hybrid": ("olmo_hybrid", {}),  # Qwen3-Next's delta net (beta in [0, 2]), post-norm attention
          "olmo-hybrid nope": ("olmo_hybrid", {"rope_parameters": {"rope_type": "default", "rope_theta": None}}),
          "olmo-hybrid grouped": ("olmo_hybrid", {"linear_num_key_heads": 2, "linear_num_value_heads": 4}),
          "xlstm": ("xlstm", {}),  # mLSTM cell (matrix memory, normalizer, max state), gate and logit soft caps
          "kimi-linear": ("kimi_linear", {})}  # KDA (per-channel decay), NoPE MLA over a latent cache, MoE


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("setting", list(CACHE_SETTINGS))
def test_replay_is_bit_identical_to_eager(ckpt_dir, monkeypatch, setting, model):
    family, overrides = MODELS[model]
    path = make(ckpt_dir, family, dtype=torch.bfloat16, **overrides)
    opts = CACHE_SETTINGS[setting]

    def greedy(i):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], logprobs=4, ignore_eos=True)

    declined_before = fallbacks.total()
    replayed, runs, llm = _run(path, True, greedy, monkeypatch, **opts)
    assert fallbacks.total() == declined_before, fallbacks.counts()  # every call on its kernel, prefill too
    assert llm.engine.runner.captured_decode is not None
    assert sorted(llm.engine.runner.captured_decode.graphs) == [1, 2, 3]
    assert runs >= 8, f"only {runs} steps were replays"
    eager, _, llm_off = _run(path, False, greedy, **opts)
    assert llm_off.engine.runner.captured_decode is None
    _assert_identical(replayed, eager)


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("checkpoint", list(DEFAULTS_BUILDERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_config_defaults_are_captured(ckpt_dir, monkeypatch, dtype, checkpoint):
    """Each family with every option of its config class at the transformers default (only sizes tiny,
    ``tests/default_configs.py``): every call on its kernel, the decode captured and replayed bit for bit as
    its eager run."""
    path = make(ckpt_dir, checkpoint, dtype=getattr(torch, dtype))

    def greedy(i):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], logprobs=4, ignore_eos=True)

    declined_before = fallbacks.total()
    replayed, runs, llm = _run(path, True, greedy, monkeypatch, dtype=dtype)
    assert fallbacks.total() == declined_before, fallbacks.counts()
    assert llm.engine.runner.captured_decode is not None, llm.engine.cpu_fast_paths.decode_reason
    assert runs >= 8, f"only {runs} steps were replays"
    _assert_identical(replayed, _run(path, False, greedy, dtype=dtype)[0])


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("model", list(MODELS))
def test_replay_against_hf(ckpt_dir, monkeypatch, model):
    """bf16 model with float32 SSM state, decode steps replayed, against HF transformers in
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
    for name, options in (("replay", {}), ("torch", {"cpu_kernels": False})):
        llm = LLM(path16, dtype="bfloat16", mamba_ssm_cache_dtype="float32", cache_memory="16MiB",
                  enable_progress_bar=False, **options)
        runs = count_replays(llm, monkeypatch)
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert (runs["replays"] > 0) == (name == "replay")
        cmp = compare([o.token_ids for o in outs], [o.logprobs for o in outs], ref)
        assert cmp.compared_tokens >= 6, (name, cmp.diverged_at)
        errors[name] = cmp.mean_abs_error
    assert errors["replay"] <= 1.25 * errors["torch"] + 1e-3, errors


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("model", list(MODELS))
def test_float32_replay_is_bit_identical_to_eager(ckpt_dir, monkeypatch, model):
    """Float32 checkpoints are captured too (float32 linears on the packed kernels): replay equals eager."""
    family, overrides = MODELS[model]
    path = make(ckpt_dir, family, dtype=torch.float32, **overrides)

    def greedy(i):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], logprobs=4, ignore_eos=True)

    declined_before = fallbacks.total()
    replayed, runs, llm = _run(path, True, greedy, monkeypatch, dtype="float32")
    assert fallbacks.total() == declined_before, fallbacks.counts()
    assert llm.engine.runner.captured_decode is not None, llm.engine.cpu_fast_paths.decode_reason
    assert runs >= 8, f"only {runs} steps were replays"
    eager, _, _ = _run(path, False, greedy, dtype="float32")
    _assert_identical(replayed, eager)


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("model", list(MODELS))
def test_replay_with_seeded_sampling(ckpt_dir, model):
    family, overrides = MODELS[model]
    path = make(ckpt_dir, family, dtype=torch.bfloat16, **overrides)

    def sampled(i):
        return SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS[i], logprobs=2,
                              ignore_eos=True)

    _assert_identical(_run(path, True, sampled)[0], _run(path, False, sampled)[0])


@needs_compiler
@needs_bf16_kernel
@pytest.mark.parametrize("family, dtype, options, reason", [
    ("granitemoehybrid_dense", torch.bfloat16, {"kv_cache_dtype": "fp8_e4m3"}, "aten."),
])
def test_uncovered_models_run_eagerly(ckpt_dir, caplog, family, dtype, options, reason):
    """The reason names the operators the forward runs outside the kernels, in one WARNING line."""
    path = make(ckpt_dir, family, dtype=dtype)
    with caplog.at_level("WARNING", logger="hybridserve.engine.cpu_fast_paths"):
        llm = LLM(path, cache_memory="16MiB", max_num_seqs=3, enable_progress_bar=False, **options)
    assert llm.engine.runner.captured_decode is None
    assert reason in llm.engine.cpu_fast_paths.decode_reason
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name.endswith("cpu_fast_paths")]
    assert len(warnings) == 1 and reason in warnings[0].getMessage(), caplog.text  # one line, the real reason
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


@needs_compiler
@needs_bf16_kernel
def test_no_capture_with_kernels_off(ckpt_dir):
    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    llm = LLM(path, cpu_kernels=False, cache_memory="16MiB", enable_progress_bar=False)
    assert llm.engine.runner.captured_decode is None
    assert "kernels are off" in llm.engine.cpu_fast_paths.decode_reason


@needs_compiler
@needs_bf16_kernel
def test_run_rejects_too_many_sequences(ckpt_dir):
    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    captured = _llm(path, True).engine.runner.captured_decode
    assert captured is not None and captured.max_rows == 3 and captured.bucket(2) == 2
    with pytest.raises(ValueError, match="1 to 3 sequences, got 4"):
        captured.run([5] * 4, [0] * 4, [0] * 4, [1] * 4, [[0]] * 4, [0] * 4)


@pytest.mark.parametrize("value", ["no", 0])
def test_option_is_validated(value):
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model="x", enforce_eager=value)


def test_default_and_cli_flag():
    assert EngineConfig(model="x").enforce_eager is False
    parser = build_parser()
    for command in (["generate", "d"], ["serve", "d"]):
        assert engine_kwargs(parser.parse_args(command))["enforce_eager"] is False
        assert engine_kwargs(parser.parse_args([*command, "--enforce-eager"]))["enforce_eager"] is True


def test_fingerprint_ignores_the_option():
    assert EngineConfig(model="x").fingerprint() == EngineConfig(model="x", enforce_eager=True).fingerprint()


@needs_compiler
@needs_bf16_kernel
def test_bad_request_is_refused_and_the_captured_engine_serves_others(ckpt_dir, monkeypatch):
    path = make(ckpt_dir, "granitemoehybrid_dense", dtype=torch.bfloat16)
    llm = _llm(path, True)
    runs = count_replays(llm, monkeypatch)
    with pytest.raises(ValueError, match="128"):  # an id outside the 128-token vocabulary, named
        llm.generate([{"prompt_token_ids": [5, 128]}], SamplingParams(max_tokens=4))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9]}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6] and runs["replays"] >= 4
    assert released_everything(llm.engine)
