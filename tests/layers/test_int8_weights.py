"""``quantization="int8"`` in every family: greedy tokens within the near-tie rule of the bf16 run on the
same checkpoint over 24 tokens, mean |Δlogprob| per family printed and bounded; the decode captured with
no fallback; float32 state with int8 weights; the option validated and on the CLI.

Near-tie rule: the int8 run may take another token than the bf16 run only at a step where the bf16
run's two best logprobs are less than ``NEAR_TIE`` apart and each run's token is in the other's top 5;
the comparison stops there (the contexts differ after it). The logits of these bf16 models are bf16:
at magnitudes of 8-32 one ulp is 0.0625-0.125, so any change to a layer moves a logprob by that much
(two bf16 runs of the same weights, with and without the kernels, differ by up to 0.07 on Jamba).
``NEAR_TIE`` = 0.3 (two to five such ulps): per-channel int8 weights moved the mean |Δlogprob| by
0.01-0.12 per family (docs/quantization.md), and every divergence seen was at a bf16 gap of 0.28 or less;
a gap wider than that closed by weight rounding would be a real error. ``MEAN_DELTA_BOUND`` = 0.15
(a bit over one ulp at 32) likewise.
"""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import fallbacks, gemm
from tests.checkpoints import make
from tests.kernels.helpers import needs_compiler

NEW_TOKENS = 24
NEAR_TIE = 0.3
MEAN_DELTA_BOUND = 0.15  # mean |Δlogprob| over the compared steps (observed 0.01-0.10)
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
#: an expert choice flips on these tiny MoE checkpoints (a jump of 0.5-0.7 in one step's logprob, then
#: small again: kimi_linear at steps 4 and 16 of prompt 1, lfm2_moe at step 4), and a later divergence
#: follows at a bf16 gap wider than NEAR_TIE: not met by per-channel int8 here (docs/quantization.md);
#: tests/models/test_int8_routing.py shows the flips are near ties and holds the routing to compare the rest
ROUTING_FLIPS = pytest.mark.xfail(strict=True, reason="int8 rounding flips an expert choice, then a token")
#: Qwen3.5-MoE's softmax router flips an expert during the prefill at a probability gap of ~0.001; the mean
#: |Δlogprob| over its 7 compared steps then lands at 0.14-0.16 depending on the CPU path (0.1535 with the AMX
#: tiles), around MEAN_DELTA_BOUND. Not strict: other paths pass. tests/models/test_int8_routing.py holds its routing
#: and bounds the rest (0.064 over 18 steps there)
SOFTMAX_ROUTING_FLIP = pytest.mark.xfail(strict=False, reason="int8 rounding flips a near-tied softmax expert choice")
FAMILIES = ["mamba", "falcon_mamba", "jamba", "qwen3_next", "minimax", "lfm2", pytest.param("lfm2_moe",
            marks=ROUTING_FLIPS), "lfm3", "zamba2", "falcon_h1", "granitemoehybrid", "granitemoehybrid_dense",
            "nemotron_h", "nemotron_h_latent", "bamba", "llama", "mamba2", "qwen3_5",
            pytest.param("qwen3_5_moe", marks=SOFTMAX_ROUTING_FLIP), "olmo_hybrid",
            "xlstm", pytest.param("kimi_linear", marks=ROUTING_FLIPS)]


def _prompts(vocab: int, lengths: tuple[int, ...] = (5, 19)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _run(path: str, prompt_lengths: tuple[int, ...] = (5, 19), **options):
    llm = LLM(path, cache_memory="16MiB", max_num_seqs=2, enable_progress_bar=False, dtype="bfloat16", **options)
    prompts = _prompts(llm.engine.hf_config.vocab_size, prompt_lengths)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return llm, [o.outputs[0] for o in outs]


def compare_near_tie(run, reference) -> tuple[float, int]:
    """(mean |Δlogprob| of the reference's token, steps compared) over the steps before any divergence;
    fails where a divergence is not a near-tie of the reference."""
    deltas = []
    for i, (a, b) in enumerate(zip(run, reference)):
        for step, (ta, tb, la, lb) in enumerate(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs)):
            if ta != tb:
                top = sorted((lp.logprob for lp in lb.values()), reverse=True)
                gap = top[0] - top[1]
                assert gap < NEAR_TIE and ta in lb and tb in la, (
                    f"prompt {i} step {step}: int8 took {ta}, bf16 {tb}; bf16's top-2 gap {gap:.3f} >= {NEAR_TIE}")
                break
            assert tb in la
            deltas.append(abs(la[tb].logprob - lb[tb].logprob))
    return sum(deltas) / max(len(deltas), 1), len(deltas)


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_weights_in_every_family(ckpt_dir, family):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    _, reference = _run(path, quantization="none")
    declined = fallbacks.total()
    llm, run = _run(path, quantization="int8")
    paths = llm.engine.cpu_fast_paths
    assert paths.quantization == "int8" and paths.w8_linears.get("int8", 0) > 0
    assert paths.decode_captured, paths.decode_reason
    assert fallbacks.total() == declined, fallbacks.counts()
    assert paths.torch_16bit_linears == 0
    mean, steps = compare_near_tie(run, reference)
    print(f"\nint8 vs bf16 {family}: mean |dlogprob| {mean:.4f} over {steps} steps")
    assert steps > 0 and mean <= MEAN_DELTA_BOUND, (family, mean, steps)


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
def test_int8_weights_with_float32_state(ckpt_dir):
    """float32 SSM and conv state with int8 weights: the cache dtypes stay the requested ones, and the run
    stays within the near-tie rule of the bf16-weight run with the same states."""
    path = make(ckpt_dir, "granitemoehybrid", dtype=torch.bfloat16)
    states = dict(mamba_ssm_cache_dtype="float32", mamba_cache_dtype="float32")
    _, reference = _run(path, quantization="none", **states)
    llm, run = _run(path, quantization="int8", **states)
    layout = llm.cache_layout()
    assert layout["mamba_ssm_cache_dtype"] == "float32" and layout["dtype"] == "bfloat16"
    assert layout["weight_bytes"]["int8"] > 0
    mean, steps = compare_near_tie(run, reference)
    assert steps >= NEW_TOKENS // 2 and mean <= MEAN_DELTA_BOUND


def test_quantization_option_is_validated_and_on_the_cli():
    assert EngineConfig(model="x").quantization == "auto"
    with pytest.raises(ValueError, match=r"quantization='int3' is not valid; allowed values: auto, none, int8"):
        EngineConfig(model="x", quantization="int3")
    with pytest.raises(ValueError, match="cpu_kernels=True"):
        EngineConfig(model="x", quantization="int8", cpu_kernels=False)
    fingerprints = {EngineConfig(model="x", quantization=q).fingerprint() for q in ("auto", "none", "int8")}
    assert len(fingerprints) == 3
    args = build_parser().parse_args(["generate", "some/dir", "--quantization", "int8"])
    assert EngineConfig(**{**engine_kwargs(args), "model": "x"}).quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "some/dir", "--quantization", "int3"])


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
def test_plan_shows_the_weight_bytes_the_engine_holds(ckpt_dir, capsys):
    """``hybridserve plan --json``: bytes per stored dtype, and an int8 estimate that is the engine's exact
    figure for a model without routers or tied weights."""
    import json

    from hybridserve.entrypoints.cli import main

    path = make(ckpt_dir, "mamba2", dtype=torch.bfloat16)
    assert main(["plan", path, "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)["weight_bytes"]
    llm, _ = _run(path, quantization="int8")
    assert weights["int8"] == llm.cache_layout()["weight_bytes"]
    assert set(weights["checkpoint"]) == {"bfloat16"}
    assert weights["checkpoint"]["bfloat16"] > sum(weights["int8"].values())
