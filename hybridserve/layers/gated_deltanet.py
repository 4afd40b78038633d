"""The gated delta net mixer (Qwen3-Next's linear attention) over the pooled conv and recurrent state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.layers.state_shapes import gated_delta_net_conv_dim, gated_delta_net_spec
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.dispatch import call
from hybridserve.ops.gated_delta import gated_delta_rule_update, gated_delta_rule_varlen


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

    def _project(self, x: torch.Tensor):
        """x: (T, hidden) -> mixed qkv (T, conv_dim), z (T, Hv, Dv), b, a (T, Hv)."""
        t = x.shape[0]
        Hk, Dk, Dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        R = self.num_v_heads // Hk
        qkvz = self.in_proj_qkvz(x).view(t, Hk, 2 * Dk + 2 * R * Dv)  # grouped per key head
        q, k, v, z = torch.split(qkvz, [Dk, Dk, R * Dv, R * Dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, Hk, 2 * R), [R, R], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # (T, conv_dim)
        return (mixed, z.reshape(t, self.num_v_heads, Dv), b.reshape(t, self.num_v_heads),
                a.reshape(t, self.num_v_heads))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        cache = batch.caches[self.layer_index]
        conv_states, rec_states = cache.state["conv"], cache.state["recurrent"]
        return call("gated_delta_net", lambda: self._forward_kernels(x, batch, conv_states, rec_states),
                    lambda: self._forward_plain(x, batch, conv_states, rec_states), x, rec_states)

    def _forward_plain(self, x: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                       rec_states: torch.Tensor) -> torch.Tensor:
        """The PyTorch body."""
        t = x.shape[0]
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed, z, b, a = self._project(x)
        beta = b.float().sigmoid()  # (T, Hv)
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # (T, Hv) log decay
        weight = self.conv1d.weight.squeeze(1)  # (conv_dim, K)
        out = torch.empty(t, Hv, Dv, dtype=torch.float32, device=x.device)  # (T, Hv, Dv)

        def split(conv_out: torch.Tensor):
            n = conv_out.shape[0]
            q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            return q.reshape(n, Hk, Dk), k.reshape(n, Hk, Dk), v.reshape(n, Hv, Dv)

        if batch.decode is not None:
            grp = batch.decode
            conv_out = causal_conv1d_update(mixed[grp.tokens], conv_states, weight, self.conv1d.bias,
                                            grp.state_indices, self.activation)  # (B, conv_dim)
            q, k, v = split(conv_out)
            out[grp.tokens] = gated_delta_rule_update(rec_states, q, k, v, g[grp.tokens], beta[grp.tokens],
                                                      grp.state_indices, use_qk_l2norm=True)
        if batch.prefill is not None:
            grp = batch.prefill
            idx = grp.state_indices
            conv_out, conv_final = causal_conv1d_varlen(mixed[grp.tokens], weight, self.conv1d.bias,
                                                        grp.cu_seqlens_q, read_slots(conv_states, idx),
                                                        self.activation)
            write_slots(conv_states, idx, conv_final)
            q, k, v = split(conv_out)
            out_p, rec_final = gated_delta_rule_varlen(q, k, v, g[grp.tokens], beta[grp.tokens], grp.cu_seqlens_q,
                                                       read_slots(rec_states, idx), use_qk_l2norm=True,
                                                       chunk_size=self.chunk_size)
            write_slots(rec_states, idx, rec_final)
            out[grp.tokens] = out_p
        y = self.norm(out.to(x.dtype).reshape(t * Hv, Dv), z.reshape(t * Hv, Dv))  # (T*Hv, Dv)
        return self.out_proj(y.reshape(t, Hv * Dv))

    def _forward_kernels(self, x: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                         rec_states: torch.Tensor) -> torch.Tensor | None:
        """The CPU-kernel path: the projections split into the conv input and z, the conv, the gated
        delta rule per group into (T, Hv Dv) in x's dtype, the gated norm, out_proj; None when declined
        before any state changed."""
        t, Hk, Hv, Dk, Dv = x.shape[0], self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        key = (self.conv1d.weight.data_ptr(), self.A_log.data_ptr(), self.dt_bias.data_ptr())
        if getattr(self, "_kernel_key", None) != key:  # float32 parameters the kernels take, made once
            self._kernel_params = (recurrent_kernels.tap_major(self.conv1d.weight),
                                   self.A_log.detach().float().contiguous(), self.dt_bias.detach().float().contiguous())
            self._kernel_key = key
        conv_w, A_log, dt_bias = self._kernel_params
        split = recurrent_kernels.gdn_split(self.in_proj_qkvz(x), Hk, Dk, (Hv // Hk) * Dv)
        if split is None or not recurrent_kernels.conv_supported(conv_states, conv_w, None, x.dtype, self.activation):
            return None
        mixed, z = split  # (T, conv_dim), (T, Hv Dv)
        ba = self.in_proj_ba(x)  # (T, 2 Hv), per key head [b | a]
        out = torch.empty(t, Hv * Dv, dtype=x.dtype)
        for i, g in enumerate(batch.groups):
            conv_out = recurrent_kernels.causal_conv1d(mixed[g.tokens], conv_states, conv_w, None, g.cu_seqlens_q,
                                                       g.state_indices, self.activation)
            if conv_out is None or not recurrent_kernels.gated_delta_rule(
                    rec_states, conv_out, ba[g.tokens], A_log, dt_bias, True, g.cu_seqlens_q, g.state_indices,
                    out[g.tokens], Hk, self.beta_scale):
                if i == 0 and conv_out is None:
                    return None
                raise RuntimeError("a gated delta net kernel declined after another ran")
        y = pointwise_kernels.norm_then_gate(out.view(t * Hv, Dv), self.norm.weight, self.norm.eps,
                                             z.view(t * Hv, Dv))
        if y is None:
            raise RuntimeError("the gated norm kernel declined after the recurrence ran")
        return self.out_proj(y.view(t, Hv * Dv))
