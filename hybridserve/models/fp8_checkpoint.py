"""FP8 checkpoints (``quantization_config: {"quant_method": "fp8", ...}`` in config.json): e4m3 weights
``X.weight`` with float32 scales beside them, as vLLM and HF transformers load them:

* per tensor (vLLM's fp8): ``X.weight_scale`` of one element;
* per output channel: ``X.weight_scale`` (N,) or (N, 1);
* block-wise (DeepSeek-V3, Qwen3-Next FP8, HF's finegrained fp8): ``X.weight_scale_inv`` (ceil(N / bn),
  ceil(K / bk)) with ``weight_block_size: [bn, bk]``; despite its name it multiplies: W = w * s.

Every form becomes the 8-bit kernel's scales (N, G) float32 with ``group`` in-features per scale (0: one
per channel). ``X.input_scale`` (static activation scales) is read and dropped: activations stay in the
model dtype (weight-only).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridserve.ops.linear_w8 import dequantize

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


def fp8_config(hf_config: Any) -> dict | None:
    """The checkpoint's fp8 ``quantization_config`` as a dict, None when it declares none; ValueError for
    another quantization method or fp8 format."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method={method!r} is not supported; allowed: fp8")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint fmt={fmt!r} is not supported; allowed: e4m3")
    return qc


def is_scale(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is an fp8 scale (not a model parameter)."""
    return name.endswith(SCALE_SUFFIXES)


def kernel_scales(weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> tuple[torch.Tensor, int]:
    """The (N, G) float32 scales and group size of fp8 ``weight`` (N, K) with its checkpoint ``scale``:
    per tensor and per channel one group (0); block-wise ``[bn, bk]`` groups of bk in-features."""
    N, K = weight.shape
    s = scale.float()
    if block is not None and s.dim() == 2 and s.numel() > 1:
        bn, bk = block
        if tuple(s.shape) != (-(-N // bn), -(-K // bk)):
            raise ValueError(f"block scales of shape {tuple(s.shape)} do not fit a ({N}, {K}) weight "
                             f"in {bn}x{bk} blocks")
        return s.repeat_interleave(bn, dim=0)[:N].contiguous(), (bk if bk < K else 0)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(N, 1).contiguous(), 0
    if s.numel() == N:
        return s.reshape(N, 1).contiguous(), 0
    raise ValueError(f"fp8 scale of shape {tuple(s.shape)} fits neither per tensor, per channel ({N}) nor blocks")


def split_fp8(loaded: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], qc: dict,
              keep: "callable") -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Resolve the fp8 weights in ``loaded`` (name -> tensor) with their ``scales`` (name -> scale tensor):
    those ``keep(name)`` accepts are returned as name -> (codes, kernel scales, group) for the 8-bit kernel
    (their entries in ``loaded`` stay, for the name and shape checks); the others are replaced in ``loaded``
    by their float32 dequantization. ValueError names an fp8 weight without a scale."""
    block = qc.get("weight_block_size")
    kept = {}
    for name, tensor in list(loaded.items()):
        if tensor.dtype != torch.float8_e4m3fn:
            continue
        base = name.removesuffix(".weight")
        scale = scales.get(base + ".weight_scale_inv", scales.get(base + ".weight_scale"))
        if scale is None or tensor.dim() != 2:
            raise ValueError(f"fp8 weight {name} {tuple(tensor.shape)} has no weight_scale / weight_scale_inv")
        s, group = kernel_scales(tensor, scale, block)
        if keep(name):
            kept[name] = (tensor, s, group)
        else:
            loaded[name] = dequantize(tensor, s, group)
    return kept
