"""Rotary position embeddings, configured from a transformers config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.ops.dispatch import call, declined
from hybridserve.ops.elementwise import apply_rotary

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_parameters"]


def rope_parameters(config: Any) -> dict:
    """The config's RoPE parameters as one dict (``rope_type``, ``rope_theta``, ...)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return params


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` of shape ``(T, rotary_dim)`` for positions, HF's half-rotation layout.

    With the CPU kernels on and a table made (:meth:`make_table`), the rows are gathered from
    ``(cos, sin)`` precomputed for every position up to the engine's longest sequence.
    """

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        self.config = config
        params = rope_parameters(config)
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq, scaling = self._inv_freq(params)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scaling)

    def _inv_freq(self, params: dict) -> tuple[torch.Tensor, float]:
        rope_type = params["rope_type"]
        if rope_type == "default":
            base = float(params["rope_theta"])
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device="cpu") / self.rotary_dim
            return 1.0 / (base ** exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS or rope_type.startswith("dynamic"):
            raise ValueError(f"rope_type={rope_type!r} is not supported; supported: default, "
                             + ", ".join(k for k in ROPE_INIT_FUNCTIONS if not k.startswith("dynamic")))
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, torch.device("cpu"))
        return inv_freq.float(), scaling

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in float32 on the module's device (after meta construction)."""
        inv_freq, _ = self._inv_freq(rope_parameters(self.config))
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def make_table(self, max_positions: int, dtype: torch.dtype) -> None:
        """Precompute ``(cos, sin)`` (max_positions, rotary_dim) in ``dtype`` for positions 0..max_positions-1."""
        positions = torch.arange(max_positions, dtype=torch.int64, device=self.inv_freq.device)
        self.tables = {**getattr(self, "tables", {}), dtype: self._compute(positions, dtype)}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int64 -> (cos, sin), each (T, rotary_dim) in ``dtype``."""
        table = getattr(self, "tables", {}).get(dtype)
        if table is None:
            declined("rope_table", "no table for " + str(dtype).removeprefix("torch."))
            return self._compute(positions, dtype)

        def kernel() -> tuple[torch.Tensor, torch.Tensor] | None:
            cos, sin = (pointwise_kernels.gather_rows(t, positions) for t in table)
            return None if cos is None or sin is None else (cos, sin)

        return call("rope_table", kernel, lambda: self._compute(positions, dtype), positions)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, rotary_dim)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

