"""The Mamba1 mixer (selective scan) over the pooled conv and SSM state (Mamba, FalconMamba, Jamba)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.layers import dense
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.state_shapes import mamba1_spec
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.dispatch import call
from hybridserve.ops.selective_scan import selective_scan_varlen, selective_state_update

#: How the dt, B and C inputs of the scan are normalized before use.
BCDT_NORMS = (None, "weighted", "weightless")


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last axis in float32, cast back to x's dtype (FalconMamba's B/C/dt norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Mamba1Mixer(nn.Module):
    """Mamba1 block: in_proj -> causal conv -> x_proj (dt, B, C) -> selective scan -> out_proj.

    Weights use HF names (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``,
    ``out_proj``). ``bcdt_norm`` selects the family's extra RMS norms on dt, B and C before the
    scan: ``None`` (Mamba), ``"weightless"`` (FalconMamba: no parameters, eps ``mixer_rms_eps``) or
    ``"weighted"`` (Jamba: ``dt_layernorm``, ``b_layernorm``, ``c_layernorm`` parameters).

    State per sequence: ``conv`` (intermediate, kernel-1) in the conv-state dtype and ``ssm``
    (intermediate, d_state) in the temporal-state dtype.
    """

    def __init__(self, layer_index: int, hidden_size: int, *, intermediate_size: int, d_state: int,
                 conv_kernel: int, dt_rank: int, dtypes: CacheDtypes, conv_bias: bool = True,
                 proj_bias: bool = False, activation: str = "silu", bcdt_norm: str | None = None,
                 norm_eps: float = 1e-6) -> None:
        super().__init__()
        if bcdt_norm not in BCDT_NORMS:
            raise ValueError(f"bcdt_norm={bcdt_norm!r}; allowed: {BCDT_NORMS}")
        self.layer_index = layer_index
        self.intermediate, self.d_state, self.dt_rank = intermediate_size, d_state, dt_rank
        self.activation = activation
        self.bcdt_norm, self.norm_eps = bcdt_norm, norm_eps
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=proj_bias)
        self.conv1d = nn.Conv1d(intermediate_size, intermediate_size, conv_kernel, groups=intermediate_size,
                                padding=conv_kernel - 1, bias=conv_bias)
        self.x_proj = nn.Linear(intermediate_size, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, intermediate_size, bias=True)
        self.dt_proj.prepack = False  # its weight is used without the bias below
        self.A_log = nn.Parameter(torch.zeros(intermediate_size, d_state))
        self.D = nn.Parameter(torch.ones(intermediate_size))
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=proj_bias)
        if bcdt_norm == "weighted":
            self.dt_layernorm = RMSNorm(dt_rank, norm_eps)
            self.b_layernorm = RMSNorm(d_state, norm_eps)
            self.c_layernorm = RMSNorm(d_state, norm_eps)
        self.spec = mamba1_spec(layer_index, dtypes, intermediate=intermediate_size, d_state=d_state,
                                conv_kernel=conv_kernel)

    def _scan_inputs(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xs: (T, inter) conv output -> raw dt (T, inter) (no bias), B (T, N), C (T, N)."""
        ts, B, C = torch.split(self.x_proj(xs), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.bcdt_norm == "weighted":
            ts, B, C = self.dt_layernorm(ts), self.b_layernorm(B), self.c_layernorm(C)
        elif self.bcdt_norm == "weightless":
            ts, B, C = (weightless_rms_norm(t, self.norm_eps) for t in (ts, B, C))
        dt = dense.linear(ts, self.dt_proj.weight)  # (T, inter); the bias is added in the op
        return dt, B, C

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        cache = batch.caches[self.layer_index]
        conv_states, ssm_states = cache.state["conv"], cache.state["ssm"]
        xs, gate = self.in_proj(x).chunk(2, dim=-1)  # (T, inter) each
        return call("mamba1_conv_scan", lambda: self._forward_kernels(x, xs, gate, batch, conv_states, ssm_states),
                    lambda: self._forward_plain(x, xs, gate, batch, conv_states, ssm_states), xs, ssm_states)

    def _forward_plain(self, x: torch.Tensor, xs: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                       conv_states: torch.Tensor, ssm_states: torch.Tensor) -> torch.Tensor:
        """The PyTorch body."""
        weight = self.conv1d.weight.squeeze(1)  # (inter, K)
        conv_out = torch.empty_like(xs)  # (T, inter)
        if batch.decode is not None:
            g = batch.decode
            conv_out[g.tokens] = causal_conv1d_update(xs[g.tokens], conv_states, weight, self.conv1d.bias,
                                                      g.state_indices, self.activation)
        if batch.prefill is not None:
            g = batch.prefill
            idx = g.state_indices
            conv_out[g.tokens], conv_final = causal_conv1d_varlen(
                xs[g.tokens], weight, self.conv1d.bias, g.cu_seqlens_q, read_slots(conv_states, idx), self.activation)
            write_slots(conv_states, idx, conv_final)
        dt, B, C = self._scan_inputs(conv_out)
        A = -torch.exp(self.A_log.float())  # (inter, N)
        y = torch.empty(x.shape[0], self.intermediate, dtype=torch.float32, device=x.device)  # (T, inter)
        if batch.decode is not None:
            g = batch.decode
            t = g.tokens
            y[t] = selective_state_update(ssm_states, conv_out[t], dt[t], A, B[t], C[t], self.D, gate[t],
                                          self.dt_proj.bias, True, g.state_indices)
        if batch.prefill is not None:
            g = batch.prefill
            t, idx = g.tokens, g.state_indices
            y[t], ssm_final = selective_scan_varlen(conv_out[t], dt[t], A, B[t], C[t], self.D, gate[t],
                                                    self.dt_proj.bias, True, g.cu_seqlens_q,
                                                    read_slots(ssm_states, idx))
            write_slots(ssm_states, idx, ssm_final)
        return self.out_proj(y.to(x.dtype))

    def _forward_kernels(self, x: torch.Tensor, xs: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                         conv_states: torch.Tensor, ssm_states: torch.Tensor) -> torch.Tensor | None:
        """The CPU-kernel path, per sequence group: conv, x_proj, the dt/B/C norms, dt_proj (float32
        sums, rounded as ``dense.linear``), the scan into y in x's dtype; None when a kernel declines
        before any state changed."""
        conv_w, conv_b, A, D, dt_bias, dt_w32, ones = self._kernel_params(x.dtype)
        if (not recurrent_kernels.conv_supported(conv_states, conv_w, conv_b, x.dtype, self.activation)
                or ssm_states.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
            return None
        y = torch.empty(x.shape[0], self.intermediate, dtype=x.dtype)  # (T, inter)
        for g in batch.groups:
            conv_out = recurrent_kernels.causal_conv1d(xs[g.tokens], conv_states, conv_w, conv_b, g.cu_seqlens_q,
                                                       g.state_indices, self.activation)  # (n, inter)
            if conv_out is None:
                return None
            ts, B, C = torch.split(self.x_proj(conv_out), [self.dt_rank, self.d_state, self.d_state], dim=-1)
            if self.bcdt_norm == "weighted":
                ts, B, C = self.dt_layernorm(ts), self.b_layernorm(B), self.c_layernorm(C)
            elif self.bcdt_norm == "weightless":  # x / rms(x): a norm whose float32 weight multiply is by 1
                ts, B, C = (pointwise_kernels.rms_norm(t, ones[:t.shape[1]], self.norm_eps, weight_in_float32=True)
                            for t in (ts, B, C))
            dt = None if ts is None else gemm.linear_f32(ts, dt_w32, x.dtype)  # (n, inter) raw, no bias
            if dt is None or B is None or C is None or not recurrent_kernels.mamba1_scan(
                    ssm_states, conv_out, dt, A, B, C, D, gate[g.tokens], dt_bias, True, g.cu_seqlens_q,
                    g.state_indices, y[g.tokens]):
                raise RuntimeError("the Mamba1 conv kernel ran but a later kernel declined the same group")
        return self.out_proj(y)

    def _kernel_params(self, dtype: torch.dtype) -> tuple:
        """float32 parameters the kernels take, cached (rebuilt when a parameter's storage changes): the
        conv weight (K, inter) tap-major and bias, A = -exp(A_log) (inter, N), D, dt_bias, the dt_proj
        weight, and ones in ``dtype`` for the weightless norms."""
        params = (self.conv1d.weight, self.conv1d.bias, self.A_log, self.D, self.dt_proj.bias, self.dt_proj.weight)
        key = (dtype, *(None if p is None else p.data_ptr() for p in params))
        if getattr(self, "_kernel_params_key", None) != key:
            bias = self.conv1d.bias
            width = max(self.dt_rank, self.d_state)
            self._kernel_params_cache = (
                recurrent_kernels.tap_major(self.conv1d.weight),
                None if bias is None else bias.detach().float().contiguous(),
                -torch.exp(self.A_log.detach().float()).contiguous(), self.D.detach().float().contiguous(),
                self.dt_proj.bias.detach().float().contiguous(), self.dt_proj.weight.detach().float().contiguous(),
                torch.ones(width, dtype=dtype))
            self._kernel_params_key = key
        return self._kernel_params_cache
