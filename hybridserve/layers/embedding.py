"""Token embeddings, gathered by the CPU kernel when it is on."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import fallbacks
from hybridserve.kernels import pointwise as pointwise_kernels


class Embedding(nn.Embedding):
    """``nn.Embedding`` (HF weight name ``weight``) whose forward takes an optional ``scale``:
    ``embedding(ids) * scale``, rounded to the weight's dtype as PyTorch rounds the product."""

    use_cpu_kernels = False  # set by the engine when the compiled CPU kernels are on and available

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """ids: (T,) int64 -> (T, embedding_dim)."""
        if self.use_cpu_kernels:
            out = pointwise_kernels.gather_rows(self.weight, ids, scale)
            if out is not None:
                return out
            fallbacks.record("embedding", fallbacks.describe(self.weight, ids))
        x = super().forward(ids)
        return x * scale if scale != 1.0 else x
