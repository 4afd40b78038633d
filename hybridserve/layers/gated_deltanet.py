"""The gated delta net mixer (Qwen3-Next's linear attention) over the pooled conv and recurrent state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.state_shapes import gated_delta_net_conv_dim, gated_delta_net_spec
from hybridserve.ops.gated_delta_net_mixer import gated_delta_net_mix


class NormThenGateRMSNorm(nn.Module):
    """HF's ``Qwen3NextRMSNormGated``: ``weight * rms_norm(x)`` (cast back to x's dtype first),
    then times ``silu(gate)`` in float32, cast to x's dtype. (Mamba2's ``GatedRMSNorm`` gates first.)"""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


def grouped_projections(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, *, num_k_heads: int,
                        num_v_heads: int, head_k_dim: int, head_v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Separate projection weights (Qwen3.5's ``in_proj_qkv`` rows ``[all q | all k | all v]``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``; value head h reads key head h // R) as :class:`GatedDeltaNet`'s grouped
    ``in_proj_qkvz`` (Hk (2 Dk + 2 R Dv), hidden) and ``in_proj_ba`` (2 Hv, hidden): the same rows, reordered.
    A ValueError names a weight of the wrong shape."""
    Hk, Hv, Dk, Dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    R, hidden = Hv // Hk, qkv.shape[-1]
    for name, w, rows in (("in_proj_qkv", qkv, 2 * Hk * Dk + Hv * Dv), ("in_proj_z", z, Hv * Dv),
                          ("in_proj_b", b, Hv), ("in_proj_a", a, Hv)):
        if tuple(w.shape) != (rows, hidden):
            raise ValueError(f"{name}.weight has shape {tuple(w.shape)}, expected {(rows, hidden)}")
    q, k, v = torch.split(qkv, [Hk * Dk, Hk * Dk, Hv * Dv])
    qkvz = torch.cat([q.view(Hk, Dk, hidden), k.view(Hk, Dk, hidden), v.view(Hk, R * Dv, hidden),
                      z.view(Hk, R * Dv, hidden)], dim=1)  # (Hk, 2 Dk + 2 R Dv, hidden)
    ba = torch.cat([b.view(Hk, R, hidden), a.view(Hk, R, hidden)], dim=1)  # (Hk, 2 R, hidden)
    return qkvz.reshape(-1, hidden), ba.reshape(-1, hidden)


class GatedDeltaNet(nn.Module):
    """in_proj_qkvz / in_proj_ba -> causal conv over (q, k, v) -> gated delta rule -> gated norm
    with z -> out_proj (HF weight names).

    Projection layout (HF): ``in_proj_qkvz`` gives, per key head, ``[q (Dk), k (Dk), v (R*Dv), z (R*Dv)]``
    and ``in_proj_ba`` per key head ``[b (R), a (R)]``, where R = Hv / Hk value heads share a key head
    (value head h reads key head h // R). The conv runs over ``[all q, all k, all v]``. Qwen3.5 checkpoints
    store the same projections apart; :func:`grouped_projections` reorders their rows into this layout.

    State per sequence: ``conv`` (conv_dim, kernel-1) in the conv-state dtype and ``recurrent``
    (Hv, Dk, Dv) in the temporal-state dtype, HF's layout (key dim before value dim).

    ``beta = beta_scale * sigmoid(b)``: 1 for Qwen3-Next, 2 for OLMo-Hybrid (``allow_neg_eigval``).
    """

    def __init__(self, layer_index: int, hidden_size: int, *, num_k_heads: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, conv_kernel: int, dtypes: CacheDtypes,
                 norm_eps: float = 1e-6, activation: str = "silu", chunk_size: int = 64,
                 beta_scale: float = 1.0) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        self.layer_index = layer_index
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.checkpoint_heads = (num_k_heads, num_v_heads)  # whole counts (a tensor-parallel rank keeps a slice)
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = gated_delta_net_conv_dim(num_k_heads, num_v_heads, head_k_dim, head_v_dim)
        self.activation, self.chunk_size, self.beta_scale = activation, chunk_size, float(beta_scale)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = NormThenGateRMSNorm(head_v_dim, norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.spec = gated_delta_net_spec(layer_index, dtypes, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                                         head_k_dim=head_k_dim, head_v_dim=head_v_dim, conv_kernel=conv_kernel)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        cache = batch.caches[self.layer_index]
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)  # grouped per key head: [q|k|v|z], [b|a]
        y = gated_delta_net_mix(self, qkvz, ba, batch, cache.state["conv"], cache.state["recurrent"], x.dtype)
        return self.out_proj(y)  # (T, hidden)
