"""Kimi delta attention (Kimi Linear's linear-attention mixer) over the pooled conv and recurrent state.

Gated DeltaNet's recurrence with a per-channel decay (``ops/kda.py``); ``layers/gated_deltanet.py``
is not reused because its chunked scan and its CPU kernel factor one scalar decay per head out of
every q.k product, which a per-channel decay does not allow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.state_shapes import kda_spec
from hybridserve.ops.kda_mixer import kda_mix


class SigmoidGatedRMSNorm(nn.Module):
    """HF's ``KimiLinearRMSNormGated``: ``weight * rms_norm(x) * sigmoid(gate)``, all in float32, cast to
    x's dtype once at the end."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: (N, hidden) -> (N, hidden) in x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


class KimiForgetGate(nn.Module):
    """``f_b_proj(f_a_proj(x))`` (a rank-``head_dim`` projection) -> per-channel log decay
    ``g = -exp(A_log[h]) * softplus(f + dt_bias)``, (T, H, Dk) float32 (HF names)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> g (T, H, Dk) float32, <= 0."""
        return self.decay(self.project(x))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> the raw forget projection (T, H Dk)."""
        return self.f_b_proj(self.f_a_proj(x))

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """The raw forget projection (T, H Dk) -> g (T, H, Dk) float32, <= 0."""
        f = f.float() + self.dt_bias.float()  # (T, H Dk)
        f = f.view(f.shape[0], self.num_heads, self.head_dim)
        return -self.A_log.float().view(self.num_heads, 1).exp() * F.softplus(f)  # softplus(y) = y past 20, as HF


class KimiDeltaAttention(nn.Module):
    """q/k/v projections -> causal conv over ``[q | k | v]`` (silu) -> KDA with l2-normed q, k and
    ``beta = sigmoid(b_proj(x))`` -> sigmoid-gated norm with ``g_b_proj(g_a_proj(x))`` -> ``o_proj``
    (HF weight names).

    State per sequence: ``conv`` (3 H Dk, kernel - 1) in the conv-state dtype and ``recurrent``
    (H, Dk, Dv) in the temporal-state dtype (key and value heads alike: Dv = Dk)."""

    def __init__(self, layer_index: int, hidden_size: int, *, num_heads: int, head_dim: int, conv_kernel: int,
                 dtypes: CacheDtypes, norm_eps: float = 1e-6, activation: str = "silu", chunk_size: int = 16) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv_dim = num_heads * head_dim
        self.conv_dim = 3 * self.qkv_dim
        self.activation, self.chunk_size = activation, chunk_size
        self.q_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)
        self.forget_gate = KimiForgetGate(hidden_size, num_heads, head_dim)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, hidden_size, bias=False)
        self.spec = kda_spec(layer_index, dtypes, num_heads=num_heads, head_dim=head_dim, conv_kernel=conv_kernel)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        cache = batch.caches[self.layer_index]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (T, H D) each
        f = self.forget_gate.project(x)  # (T, H D) raw forget projection
        b = self.b_proj(x)  # (T, H) raw beta projection
        gate = self.g_b_proj(self.g_a_proj(x))  # (T, H D)
        y = kda_mix(self, q, k, v, f, b, gate, batch, cache.state["conv"], cache.state["recurrent"], x.dtype)
        return self.o_proj(y)  # (T, hidden)
