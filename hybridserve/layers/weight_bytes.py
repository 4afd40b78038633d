"""The bytes a loaded model's weights hold, per storage dtype (``LLM.cache_layout()["weight_bytes"]``)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.layers.linear_w4 import INT4_FORMAT, W4Linear
from hybridserve.layers.linear_w6k import W6KLinear
from hybridserve.layers.linear_w8 import W8Linear
from hybridserve.layers.moe import FusedExperts


def _name(dtype: torch.dtype) -> str:
    return {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", INT4_FORMAT: "int4"}.get(
        dtype, str(dtype).removeprefix("torch."))


def _address_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's memory starts and how many bytes it holds. A oneDNN-prepacked weight
    (:class:`~hybridserve.layers.packed_linear.PackedLinear`, an opaque ``torch._mkldnn`` tensor) has no
    storage: oneDNN's own pointer and buffer size, which includes its blocked layout's padding (a
    (1000, 33) bf16 weight holds 131072 bytes, not 66000), as that is what the packed copy occupies."""
    if t.is_mkldnn:
        ops = torch.ops.mkldnn
        if hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes"):
            return ops.data_ptr(t), ops._nbytes(t)
        return id(t), t.numel() * t.element_size()  # a torch without them: the logical size, no padding
    return t.data_ptr(), t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes per dtype of every parameter, buffer and packed weight, each tensor once (a tied weight and
    its packed copy are two). 8-bit packs count under their codes' dtype, with their float32 scales; 4-bit packs
    under ``int4``, with their scales; Q6_K packs under ``q6_k``."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}

    def add(t: torch.Tensor, label: str) -> None:
        key = _address_and_bytes(t)
        if t.numel() and key not in seen:
            seen.add(key)
            out[label] = out.get(label, 0) + key[1]

    for m in model.modules():
        for name, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None:
                label = _name(t.dtype)
                if name == "packed_weight" and isinstance(m, (W8Linear, W4Linear, W6KLinear)):
                    label = "int4" if isinstance(m, W4Linear) else "q6_k" if isinstance(m, W6KLinear) else _name(m.fmt)
                add(t, label)
        if isinstance(m, FusedExperts) and m.packed is not None:
            for t in (t for ts in m.packed.values() for t in ts):
                add(t, _name(m.weight_format) if m.weight_format is not None else _name(t.dtype))
    return dict(sorted(out.items()))
