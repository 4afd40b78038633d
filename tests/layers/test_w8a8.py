"""``quantization="w8a8"``: int8 weights, and each linear's activations quantized to int8 per row at every call.

- The engine's W8A8 run equals, bit for bit, the same run with every W8A8 call declined to the plain-PyTorch
  reference (``ops/linear_w8.py: linear_w8a8_ref``), tokens and logprobs.
- A request's tokens and logprobs do not depend on what shares its steps (per-row scales, exact integer
  sums): alone and batched give the same bits.
- Against the bf16 run of the same checkpoint, the near-tie rule and mean |Δlogprob| bound of
  ``tests/layers/test_int8_weights.py``, in the families where activation rounding keeps to it; the Qwen3-Next-like
  MoE layout moves further, and xLSTM (exponential gates) is at the rule's edge (docs/quantization.md): both
  are marked.
"""

from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import fallbacks, gemm, linear_w8
from tests.checkpoints import make
from tests.kernels.helpers import needs_compiler
from tests.layers.test_int8_weights import MEAN_DELTA_BOUND, _run, compare_near_tie

needs_kernels = pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
#: activation rounding moves the Qwen3-Next-like MoE layout past the int8 rule: a mean |Δlogprob| of 0.22 over
#: its 8 compared steps (its routers see the rounded activations of the layers before them)
WIDER = pytest.mark.xfail(strict=True, reason="W8A8 activation rounding moves this family past the int8 rule")
#: xLSTM's exponential gates make it sensitive to single code flips: with these codes it keeps to the rule
#: (mean 0.098 over 27 steps), but quantizing by x / s instead of x * (127 / max|x|), which moves a few codes by
#: one, made it part at step 1 of a prompt at a bf16 gap of 0.86. Not strict: it is at the rule's edge
EDGE = pytest.mark.xfail(strict=False, reason="xLSTM's gates amplify single activation code flips")


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 19, 40, 7)]


def _generate(llm: LLM, prompts: list[list[int]]):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]


def _llm(path: str) -> LLM:
    return LLM(path, cache_memory="16MiB", max_num_seqs=4, enable_progress_bar=False, dtype="bfloat16",
               quantization="w8a8", enable_prefix_caching=False)


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


@needs_compiler
@needs_kernels
@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next", "xlstm", "lfm2"])
def test_w8a8_run_equals_its_plain_pytorch_run(ckpt_dir, family, monkeypatch):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    declined = fallbacks.total()
    llm = _llm(path)
    prompts = _prompts(llm.engine.hf_config.vocab_size)[:2]
    fast = _generate(llm, prompts)
    paths = llm.engine.cpu_fast_paths
    assert paths.quantization == "w8a8" and paths.decode_captured, paths.decode_reason
    assert fallbacks.total() == declined, fallbacks.counts()
    monkeypatch.setattr(linear_w8, "linear_w8a8", lambda *args: None)  # every call declined: the reference
    plain = _generate(_llm(path), prompts)
    assert sum(n for (op, _), n in fallbacks.counts().items() if op == "linear_w8a8") > 0
    assert all(_same(a, b) for a, b in zip(fast, plain)), [(a.token_ids, b.token_ids) for a, b in zip(fast, plain)]


@needs_compiler
@needs_kernels
@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next"])
def test_w8a8_request_is_the_same_alone_and_batched(ckpt_dir, family):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    llm = _llm(path)
    prompts = _prompts(llm.engine.hf_config.vocab_size)
    alone = _generate(llm, prompts[:1])[0]
    batched = _generate(llm, prompts)
    assert _same(alone, batched[0])
    assert not all(_same(batched[0], b) for b in batched[1:])  # the batch really held other requests


@needs_compiler
@needs_kernels
@pytest.mark.parametrize("family", ["mamba2", "granitemoehybrid", "nemotron_h", "lfm2", "llama", "falcon_h1",
                                    "zamba2", "jamba", pytest.param("xlstm", marks=EDGE),
                                    pytest.param("qwen3_next", marks=WIDER)])
def test_w8a8_against_bf16(ckpt_dir, family):
    path = make(ckpt_dir, family, dtype=torch.bfloat16)
    _, reference = _run(path, quantization="none")
    llm, run = _run(path, quantization="w8a8")
    assert llm.engine.cpu_fast_paths.quantization == "w8a8"
    mean, steps = compare_near_tie(run, reference)
    print(f"\nw8a8 vs bf16 {family}: mean |dlogprob| {mean:.4f} over {steps} steps")
    assert steps > 0 and mean <= MEAN_DELTA_BOUND, (family, mean, steps)


def test_w8a8_option_is_validated_and_on_the_cli():
    with pytest.raises(ValueError, match=r"quantization='w8a8' runs on hybridserve's compiled CPU kernels"):
        EngineConfig(model="x", quantization="w8a8", cpu_kernels=False)
    assert (EngineConfig(model="x", quantization="w8a8").fingerprint()
            != EngineConfig(model="x", quantization="int8").fingerprint())
    args = build_parser().parse_args(["generate", "some/dir", "--quantization", "w8a8"])
    assert EngineConfig(**{**engine_kwargs(args), "model": "x"}).quantization == "w8a8"


@needs_compiler
@needs_kernels
def test_w8a8_below_the_tiles_says_it_is_slow(ckpt_dir, caplog):
    """Below avx512_bf16 (avx2 here) the engine warns that W8A8 sums on integer vectors; on AVX-512 VNNI
    (avx512_bf16) and on the AMX-INT8 tiles it does not."""
    from hybridserve.kernels import isa

    path = make(ckpt_dir, "granitemoehybrid", dtype=torch.bfloat16)
    level = "avx2" if not isa.cpu_info().missing("avx2") else "generic"
    previous = isa.cap()
    try:
        with caplog.at_level("WARNING", logger="hybridserve.engine.cpu_fast_paths"):
            LLM(path, cache_memory="16MiB", enable_progress_bar=False, quantization="w8a8", cpu_isa=level)
        assert "sums on integer vectors" in caplog.text
        for fast in ("avx512_bf16", "amx"):
            if isa.cpu_info().missing(fast):
                continue
            caplog.clear()
            with caplog.at_level("WARNING", logger="hybridserve.engine.cpu_fast_paths"):
                LLM(path, cache_memory="16MiB", enable_progress_bar=False, quantization="w8a8", cpu_isa=fast)
            assert "sums on integer vectors" not in caplog.text, fast
    finally:
        isa.set_cap(previous)
