"""Token embeddings, gathered by the CPU kernel when it is on."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.ops.dispatch import call


class Embedding(nn.Embedding):
    """``nn.Embedding`` (HF weight name ``weight``) whose forward takes an optional ``scale``:
    ``embedding(ids) * scale``, rounded to the weight's dtype as PyTorch rounds the product."""

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """ids: (T,) int64 -> (T, embedding_dim)."""
        def plain() -> torch.Tensor:
            x = super(Embedding, self).forward(ids)
            return x * scale if scale != 1.0 else x

        return call("embedding", lambda: pointwise_kernels.gather_rows(self.weight, ids, scale), plain,
                    self.weight, ids)
