"""Kimi delta attention (Kimi Linear's linear-attention mixer) over the pooled conv and recurrent state.

Gated DeltaNet's recurrence with a per-channel decay (``ops/kda.py``); ``layers/gated_deltanet.py``
is not reused because its chunked scan and its CPU kernel factor one scalar decay per head out of
every q.k product, which a per-channel decay does not allow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.layers.state_shapes import kda_spec
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.dispatch import call
from hybridserve.ops.kda import kda_update, kda_varlen


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
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()  # (T, H Dk)
        f = f.view(x.shape[0], self.num_heads, self.head_dim)
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
        conv_states, rec_states = cache.state["conv"], cache.state["recurrent"]
        return call("kda", lambda: self._forward_kernels(x, batch, conv_states, rec_states),
                    lambda: self._forward_plain(x, batch, conv_states, rec_states), x, rec_states)

    def _forward_plain(self, x: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                       rec_states: torch.Tensor) -> torch.Tensor:
        """The PyTorch body."""
        t, H, D = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (T, 3 H D)
        g = self.forget_gate(x)  # (T, H, D) float32
        beta = self.b_proj(x).float().sigmoid()  # (T, H)
        weight = self.conv1d.weight.squeeze(1)  # (conv_dim, K)
        out = torch.empty(t, H, D, dtype=torch.float32, device=x.device)  # (T, H, Dv)

        def split(conv_out: torch.Tensor):
            n = conv_out.shape[0]
            return [part.reshape(n, H, D) for part in torch.split(conv_out, self.qkv_dim, dim=-1)]

        if batch.decode is not None:
            grp = batch.decode
            conv_out = causal_conv1d_update(mixed[grp.tokens], conv_states, weight, None, grp.state_indices,
                                            self.activation)  # (B, conv_dim)
            q, k, v = split(conv_out)
            out[grp.tokens] = kda_update(rec_states, q, k, v, g[grp.tokens], beta[grp.tokens], grp.state_indices,
                                         use_qk_l2norm=True)
        if batch.prefill is not None:
            grp = batch.prefill
            idx = grp.state_indices
            conv_out, conv_final = causal_conv1d_varlen(mixed[grp.tokens], weight, None, grp.cu_seqlens_q,
                                                        read_slots(conv_states, idx), self.activation)
            write_slots(conv_states, idx, conv_final)
            q, k, v = split(conv_out)
            out_p, rec_final = kda_varlen(q, k, v, g[grp.tokens], beta[grp.tokens], grp.cu_seqlens_q,
                                          read_slots(rec_states, idx), use_qk_l2norm=True,
                                          chunk_size=self.chunk_size)
            write_slots(rec_states, idx, rec_final)
            out[grp.tokens] = out_p
        gate = self.g_b_proj(self.g_a_proj(x))  # (T, H D)
        y = self.o_norm(out.to(x.dtype).reshape(t * H, D), gate.reshape(t * H, D))  # (T H, D)
        return self.o_proj(y.reshape(t, H * D))

    def _kernel_params(self) -> tuple:
        """The float32 parameters the kernels take, made once per weight: the conv weight of q, k and v
        apart, tap-major (K, H D) each; A_log (H,); dt_bias (H D,); the norm weight (D,)."""
        fg = self.forget_gate
        key = (self.conv1d.weight.data_ptr(), fg.A_log.data_ptr(), fg.dt_bias.data_ptr(), self.o_norm.weight.data_ptr())
        if getattr(self, "_kernel_key", None) != key:
            n = self.qkv_dim
            convs = tuple(recurrent_kernels.tap_major(self.conv1d.weight[i * n:(i + 1) * n]) for i in range(3))
            self._kernel_tensors = (convs, fg.A_log.detach().float().reshape(-1).contiguous(),
                                    fg.dt_bias.detach().float().contiguous(),
                                    self.o_norm.weight.detach().float().contiguous())
            self._kernel_key = key
        return self._kernel_tensors

    def _forward_kernels(self, x: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                         rec_states: torch.Tensor) -> torch.Tensor | None:
        """The CPU-kernel path: the projections, the conv of q, k and v (each over its own channels of
        the conv state), the KDA recurrence with the sigmoid-gated norm per group into (T, H D) in x's
        dtype (``recurrent_kernels.kda``), o_proj; None when declined before any state changed."""
        convs, A_log, dt_bias, norm_w = self._kernel_params()
        n = self.qkv_dim
        conv_parts = [conv_states[:, i * n:(i + 1) * n] for i in range(3)]  # (slots, H D, K-1) each
        if not all(recurrent_kernels.conv_supported(st, w, None, x.dtype, self.activation)
                   for st, w in zip(conv_parts, convs)):
            return None
        t = x.shape[0]
        projected = (self.q_proj(x), self.k_proj(x), self.v_proj(x))  # (T, H D) each
        f = self.forget_gate.f_b_proj(self.forget_gate.f_a_proj(x))  # (T, H D) raw forget projection
        b = self.b_proj(x)  # (T, H) raw beta projection
        gate = self.g_b_proj(self.g_a_proj(x))  # (T, H D)
        out = torch.empty(t, n, dtype=x.dtype)  # (T, H D)
        for i, g in enumerate(batch.groups):
            q, k, v = (recurrent_kernels.causal_conv1d(p[g.tokens], st, w, None, g.cu_seqlens_q, g.state_indices,
                                                       self.activation)
                       for p, st, w in zip(projected, conv_parts, convs))
            if i == 0 and q is None:
                return None
            if (q is None or k is None or v is None or not recurrent_kernels.kda(
                    rec_states, q, k, v, f[g.tokens], b[g.tokens], A_log, dt_bias, True, g.cu_seqlens_q,
                    g.state_indices, out[g.tokens], gate[g.tokens], norm_w, self.o_norm.eps)):
                raise RuntimeError("a Kimi delta attention kernel declined after another ran")
        return self.o_proj(out)
