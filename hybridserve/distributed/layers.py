"""Layers whose tensor-parallel forward differs from the whole layer's (set by ``sharding`` on a built layer)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.distributed.group import TPGroup
from hybridserve.layers import dense
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.norms import RMSNorm
from hybridserve.ops.dispatch import declined


class VocabParallelEmbedding(Embedding):
    """An :class:`Embedding` holding rows ``vocab_start ..`` of the vocabulary: ids outside them embed to zero
    here, and the ranks' embeddings are summed."""

    vocab_start: int
    group: TPGroup

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """ids: (T,) int64 over the whole vocabulary -> (T, embedding_dim)."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)  # (T,)
        x = super().forward(torch.where(inside, local, torch.zeros_like(local)), scale)  # (T, D)
        x = x.masked_fill(~inside[:, None], 0)
        return self.group.all_reduce(x)


class RowParallelLinear(nn.Linear):
    """An ``nn.Linear`` holding a slice of its input features, whose output is summed over the ranks (a
    projection inside a layer whose result every rank needs whole, e.g. Mamba1's ``x_proj``). Not packed
    for the CPU kernels (the packers take plain ``nn.Linear`` only): these projections are small."""

    group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features / ranks) -> (..., out_features), the same on every rank."""
        return self.group.all_reduce(dense.linear(x, self.weight, self.bias))


class SpanningNormMamba2Mixer(Mamba2Mixer):
    """A Mamba2 shard with fewer groups than ranks, whose gated norm's group spans ranks: each rank holds
    ``intermediate`` channels of group ``norm_group`` (of ``norm_groups``), and the sums of squares are summed
    over the ranks (one column per group, zeros in the others') before the rsqrt."""

    group: TPGroup
    norm_group: int
    norm_groups: int
    norm_group_size: int  # channels of one whole group, over all its ranks

    def _gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y: (T, inter) float32 scan output, gate: (T, inter) -> (T, inter) in ``dtype``."""
        if self.norm is None:
            return super()._gate_and_norm(y, gate, dtype)
        declined("gated_rms_norm", "the norm's groups span tensor-parallel ranks")
        x = y if self.norm_in_float32 or self.norm_before_gate else y.to(dtype)  # what the whole layer norms
        xf = x.float()  # (T, inter)
        if not self.norm_before_gate:
            xf = xf * nn.functional.silu(gate.float())
        sums = torch.zeros(xf.shape[0], self.norm_groups, dtype=torch.float32, device=xf.device)  # (T, G)
        sums[:, self.norm_group] = xf.pow(2).sum(-1)
        self.group.all_reduce(sums)
        mean = sums[:, self.norm_group:self.norm_group + 1] / self.norm_group_size  # (T, 1)
        out = self.norm.weight * (xf * torch.rsqrt(mean + self.norm.eps)).to(x.dtype)  # as GatedRMSNorm
        if self.norm_before_gate:
            out = out * nn.functional.silu(gate.float())
        return out.to(dtype)


class SpanningRMSNorm(RMSNorm):
    """An :class:`RMSNorm` over a width split across the ranks (``full_width`` in all): each rank normalizes its
    slice by the root mean square of the whole, its sum of squares summed over the ranks."""

    group: TPGroup
    full_width: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, width / ranks) -> the same shape, in x's dtype."""
        declined("rms_norm", "the norm's width spans tensor-parallel ranks")
        dtype = x.dtype
        xf = x.float()
        sums = self.group.all_reduce(xf.pow(2).sum(-1, keepdim=True))  # (T, 1)
        xf = xf * torch.rsqrt(sums / self.full_width + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        if self.weight_in_float32:
            return (xf * self.weight.float()).to(dtype)
        return self.weight * xf.to(dtype)

    def add_and_norm(self, *args, **kwargs):
        raise NotImplementedError("a spanning norm normalizes a layer's inner width, never a residual stream")


def _lightning_attention() -> type:
    from hybridserve.models.minimax import LightningAttention

    return LightningAttention


class HeadSliceLightningAttention(_lightning_attention()):
    """MiniMax's linear attention holding heads ``head_start ..`` of ``total_heads``: each keeps the decay
    rate it has in the whole layer."""

    total_heads: int
    head_start: int

    def reset_buffers(self) -> None:
        from hybridserve.models.minimax import slope_rates

        rate = slope_rates(self.total_heads, self.layer_index, self.num_layers)[self.head_start:][:self.num_heads]
        self.slope_rate = rate.to(self.slope_rate.device)
