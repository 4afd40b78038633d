"""``LLM.cache_layout()["weight_bytes"]`` with oneDNN-prepacked bf16 weights (``cpu_kernels=False``): a
packed weight is an opaque ``torch._mkldnn`` tensor without storage (no ``data_ptr()``); it counts once,
with the bytes its oneDNN buffer holds (the logical weight plus the blocked layout's padding)."""

from __future__ import annotations

import glob

import pytest
import torch
from safetensors import safe_open

from hybridserve import LLM
from hybridserve.layers.packed_linear import PackedLinear, prepack_available
from tests.checkpoints import make


def _checkpoint_bytes(path: str) -> dict[str, int]:
    """Bytes per dtype of every tensor stored in the checkpoint (parameter count x element size)."""
    out: dict[str, int] = {}
    for file in glob.glob(f"{path}/*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                dtype = str(t.dtype).removeprefix("torch.")
                out[dtype] = out.get(dtype, 0) + t.numel() * t.element_size()
    return out


def _llm(path: str, cpu_kernels: bool) -> LLM:
    return LLM(path, cpu_kernels=cpu_kernels, dtype="bfloat16", cache_memory="16MiB", enable_progress_bar=False)


def test_cache_layout_counts_onednn_prepacked_weights(ckpt_dir):
    """Bamba (Mamba2 + attention, untied head): the kernels-off run reports every checkpoint byte once, its
    packed linears at their oneDNN buffer size (at least the logical size); the tensors it does not pack
    (norms, the embedding, float32 buffers) count as in the kernels-on run."""
    path = make(ckpt_dir, "bamba", dtype=torch.bfloat16)
    stored = _checkpoint_bytes(path)
    assert set(stored) == {"bfloat16"} and stored["bfloat16"] > 0
    llm = _llm(path, cpu_kernels=False)
    packed = {id(m.packed_weight): m.packed_weight for m in llm.engine.model.modules() if isinstance(m, PackedLinear)}
    if not prepack_available():
        assert not packed
        pytest.skip("oneDNN's bf16 prepack does not run at this ISA level: no packed weight to count")
    assert packed and all(w.is_mkldnn for w in packed.values())
    with pytest.raises(RuntimeError, match="storage"):
        next(iter(packed.values())).data_ptr()  # what weight_bytes used to call

    off = llm.cache_layout()["weight_bytes"]
    padding = sum(torch.ops.mkldnn._nbytes(w) - w.numel() * w.element_size() for w in packed.values())
    assert padding >= 0
    # each weight once: the checkpoint's bf16 bytes (parameter count x 2) plus what oneDNN pads them with
    assert off["bfloat16"] == stored["bfloat16"] + padding, (off, stored, padding)
    on = _llm(path, cpu_kernels=True).cache_layout()["weight_bytes"]
    assert on["bfloat16"] >= stored["bfloat16"]
    assert {k: v for k, v in off.items() if k != "bfloat16"} == {k: v for k, v in on.items() if k != "bfloat16"}
