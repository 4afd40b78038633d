"""The Mamba2 mixer (SSD) over the pooled conv and SSM state."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.engine.forward_batch import ForwardBatch
from hybridserve.layers.norms import GatedRMSNorm
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.ssd import mamba2_chunk_scan_varlen, mamba2_state_update


class Mamba2Mixer(nn.Module):
    """Mamba2 block: in_proj -> causal conv -> SSD -> gated norm -> out_proj (HF weight names).

    State per sequence: ``conv`` (conv_dim, kernel-1) in the conv-state dtype and ``ssm``
    (heads, head_dim, d_state) in the temporal-state dtype.
    """

    def __init__(self, layer_index: int, hidden_size: int, *, num_heads: int, head_dim: int, d_state: int,
                 n_groups: int, conv_kernel: int, chunk_size: int, dtypes: CacheDtypes,
                 intermediate_size: int | None = None, conv_bias: bool = True, proj_bias: bool = False,
                 norm_eps: float = 1e-6, norm_group_size: int | None = None,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")), activation: str = "silu") -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.head_dim, self.d_state, self.n_groups = num_heads, head_dim, d_state, n_groups
        self.intermediate = intermediate_size if intermediate_size is not None else num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * d_state
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.activation = activation
        self.in_proj = nn.Linear(hidden_size, self.intermediate + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.intermediate, norm_group_size or self.intermediate // n_groups, norm_eps)
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias=proj_bias)
        self.spec = LayerCacheSpec(layer_index, "mamba2", state=(
            dtypes.conv_state("conv", (self.conv_dim, conv_kernel - 1)),
            dtypes.temporal_state("ssm", (num_heads, head_dim, d_state)),
        ))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        cache = batch.caches[self.layer_index]
        conv_states, ssm_states = cache.state["conv"], cache.state["ssm"]
        proj = self.in_proj(x)  # (T, inter + conv_dim + H)
        gate, xbc, dt = torch.split(proj, [self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)  # (conv_dim, K)
        A = -torch.exp(self.A_log.float())  # (H,)
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        y = torch.empty(x.shape[0], H, P, dtype=torch.float32, device=x.device)  # (T, H, P)
        if batch.decode is not None:
            g = batch.decode
            conv_out = causal_conv1d_update(xbc[g.tokens], conv_states, weight, self.conv1d.bias,
                                            g.state_indices, self.activation)  # (B, conv_dim)
            xs, B, C = torch.split(conv_out, [self.intermediate, G * N, G * N], dim=-1)
            n = g.num_tokens
            y[g.tokens] = mamba2_state_update(
                ssm_states, xs.reshape(n, H, P), dt[g.tokens], A, B.reshape(n, G, N), C.reshape(n, G, N),
                self.D, self.dt_bias, True, self.time_step_limit, g.state_indices)
        if batch.prefill is not None:
            g = batch.prefill
            idx = g.state_indices
            conv_out, conv_final = causal_conv1d_varlen(xbc[g.tokens], weight, self.conv1d.bias, g.cu_seqlens_q,
                                                        conv_states[idx].float(), self.activation)
            conv_states[idx] = conv_final.to(conv_states.dtype)
            xs, B, C = torch.split(conv_out, [self.intermediate, G * N, G * N], dim=-1)
            n = g.num_tokens
            y_p, ssm_final = mamba2_chunk_scan_varlen(
                xs.reshape(n, H, P), dt[g.tokens], A, B.reshape(n, G, N), C.reshape(n, G, N), self.chunk_size,
                self.D, self.dt_bias, True, self.time_step_limit, g.cu_seqlens_q, ssm_states[idx].float())
            ssm_states[idx] = ssm_final.to(ssm_states.dtype)
            y[g.tokens] = y_p
        y = self.norm(y.reshape(x.shape[0], -1).to(x.dtype), gate)  # (T, inter)
        return self.out_proj(y)
