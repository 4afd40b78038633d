"""The Mamba1 mixer (selective scan) over the pooled conv and SSM state (Mamba, FalconMamba, Jamba)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers import dense
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.state_shapes import mamba1_spec
from hybridserve.ops.mamba1_mixer import mamba1_mix

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

    def scan_inputs(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xs: (T, inter) conv output -> raw dt (T, inter) (no bias), B (T, N), C (T, N), in plain PyTorch
        (the op's kernel body computes them on the kernels)."""
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
        y = mamba1_mix(self, xs, gate, batch, conv_states, ssm_states, x.dtype)  # (T, inter)
        return self.out_proj(y)
