"""FP8 checkpoints: a tiny model whose safetensors hold ``float8_e4m3fn`` weights with ``weight_scale``
(per tensor, per channel) or ``weight_scale_inv`` with ``weight_block_size`` (block-wise, as DeepSeek-V3
and Qwen3-Next FP8 releases), and ``quantization_config: {"quant_method": "fp8", ...}`` in config.json,
loads and runs on the 8-bit kernel, and matches its dequantized bf16 twin (the same weights, w * s
rounded to bf16, saved as a plain checkpoint)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from hybridserve.kernels import fallbacks, gemm
from hybridserve.ops.linear_w8 import dequantize
from tests.checkpoints import make
from tests.kernels.helpers import needs_compiler
from tests.layers.test_int8_weights import compare_near_tie

PARAMS = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
BLOCK = [32, 32]
FP8_MAX = 448.0


def _quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(e4m3 codes, scale tensors by suffix, the float32 dequantized weight) of w (N, K) under ``scheme``."""
    w = w.float()
    N, K = w.shape
    if scheme == "block":
        bn, bk = BLOCK
        rows, cols = -(-N // bn), -(-K // bk)
        padded = torch.nn.functional.pad(w, (0, cols * bk - K, 0, rows * bn - N)).reshape(rows, bn, cols, bk)
        s = padded.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # (rows, cols)
        full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:N, :K]
        q = (w / full).to(torch.float8_e4m3fn)
        return q, {"weight_scale_inv": s}, q.float() * full
    s = (w.abs().amax() if scheme == "tensor" else w.abs().amax(dim=1, keepdim=True)).clamp(min=1e-12) / FP8_MAX
    q = (w / s).to(torch.float8_e4m3fn)
    scale = s.reshape(()) if scheme == "tensor" else s  # () or (N, 1)
    return q, {"weight_scale": scale, "input_scale": torch.tensor(1.0)}, dequantize(q, s.reshape(-1, 1).expand(N, 1))


def _fp8_pair(src: str, out: str, scheme: str) -> tuple[str, str]:
    """From checkpoint ``src``: an fp8 checkpoint (every 2-D projection weight but embeddings, norms and the
    LM head in e4m3) and its dequantized bf16 twin."""
    fp8_dir, twin_dir = os.path.join(out, f"fp8-{scheme}"), os.path.join(out, f"twin-{scheme}")
    if os.path.isfile(os.path.join(twin_dir, "config.json")):
        return fp8_dir, twin_dir
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, twin = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            q, scales, deq = _quantize(t, scheme)
            fp8[name] = q
            fp8.update({name.removesuffix("weight") + k: v for k, v in scales.items()})
            twin[name] = deq.to(torch.bfloat16)
        else:
            fp8[name] = twin[name] = t.to(torch.bfloat16)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["dtype"] = "bfloat16"
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic" if scheme == "block" else "static", "fmt": "e4m3"}
    if scheme == "block":
        qc["weight_block_size"] = BLOCK
    for folder, weights, cfg in ((fp8_dir, fp8, {**config, "quantization_config": qc}), (twin_dir, twin, config)):
        os.makedirs(folder, exist_ok=True)
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
    return fp8_dir, twin_dir


def _generate(path: str, **options):
    llm = LLM(path, cache_memory="16MiB", max_num_seqs=2, enable_progress_bar=False, **options)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 19)]
    return llm, [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]


@needs_compiler
@pytest.mark.skipif(not gemm.available(), reason="the linear kernels did not build")
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoint_matches_its_dequantized_twin(ckpt_dir, tmp_path_factory, scheme):
    src = make(ckpt_dir, "granitemoehybrid_dense")
    fp8_dir, twin_dir = _fp8_pair(src, str(tmp_path_factory.mktemp(f"fp8-{scheme}")), scheme)
    _, reference = _generate(twin_dir)
    declined = fallbacks.total()
    llm, run = _generate(fp8_dir)
    paths = llm.engine.cpu_fast_paths
    assert paths.quantization == "fp8" and paths.w8_linears.get("fp8_e4m3", 0) > 0, paths.as_dict()
    assert paths.decode_captured and fallbacks.total() == declined
    assert llm.cache_layout()["weight_bytes"]["fp8_e4m3"] > 0
    mean, steps = compare_near_tie(run, reference)
    print(f"\nfp8 ({scheme}) vs its bf16 twin: mean |dlogprob| {mean:.4f} over {steps} steps")
    assert steps > 0 and mean <= 0.05, (mean, steps)
    # quantization="none" dequantizes at load: the twin's weights exactly (w * s rounds to bf16 alike)
    _, dequantized = _generate(fp8_dir, quantization="none")
    assert [o.token_ids for o in dequantized] == [o.token_ids for o in reference]


def test_fp8_scales_are_read_in_every_layout():
    from hybridserve.models.fp8_checkpoint import fp8_config, kernel_scales

    w = torch.randn(70, 100).to(torch.float8_e4m3fn)
    s, group = kernel_scales(w, torch.tensor(0.5), None)
    assert s.shape == (70, 1) and group == 0 and (s == 0.5).all()
    s, group = kernel_scales(w, torch.arange(70.0).reshape(70, 1), None)
    assert group == 0 and torch.equal(s[:, 0], torch.arange(70.0))
    s, group = kernel_scales(w, torch.arange(6.0).reshape(3, 2), [32, 64])
    assert s.shape == (70, 2) and group == 64 and s[33, 1].item() == 3.0 and s[69, 0].item() == 4.0
    with pytest.raises(ValueError, match="do not fit"):
        kernel_scales(w, torch.ones(2, 2), [32, 64])

    class Config:
        quantization_config = {"quant_method": "awq"}

    with pytest.raises(ValueError, match="quant_method='awq' is not supported; allowed: fp8"):
        fp8_config(Config())
