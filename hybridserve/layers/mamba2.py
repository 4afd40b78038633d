"""The Mamba2 mixer (SSD) over the pooled conv and SSM state."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.norms import GatedRMSNorm
from hybridserve.layers.state_shapes import mamba2_conv_dim, mamba2_spec
from hybridserve.ops.elementwise import scale
from hybridserve.ops.gated_norm import gate_and_norm
from hybridserve.ops.mamba2_mixer import mamba2_conv_scan


class Mamba2Mixer(nn.Module):
    """Mamba2 block: in_proj -> causal conv -> SSD -> gated norm -> out_proj (HF weight names).

    State per sequence: ``conv`` (conv_dim, kernel-1) in the conv-state dtype and ``ssm``
    (heads, head_dim, d_state) in the temporal-state dtype.

    Options for families that deviate from plain Mamba2 (the defaults keep the plain behaviour):
    ``gated_norm=False`` drops the norm (no ``norm.weight``): ``y * silu(gate)`` (Falcon-H1 without
    ``mamba_rms_norm``); ``norm_before_gate`` gives ``norm(y) * silu(gate)``; ``norm_in_float32`` feeds
    the norm the float32 scan output and casts after it (HF Zamba2 and Falcon-H1); ``out_proj_bias``
    (None: ``proj_bias``); ``proj_multipliers`` scales the in_proj output segments (gate, x, B, C, dt)
    by five constants (Falcon-H1's muP vector).
    """

    def __init__(self, layer_index: int, hidden_size: int, *, num_heads: int, head_dim: int, d_state: int,
                 n_groups: int, conv_kernel: int, chunk_size: int, dtypes: CacheDtypes,
                 intermediate_size: int | None = None, conv_bias: bool = True, proj_bias: bool = False,
                 norm_eps: float = 1e-6, norm_group_size: int | None = None,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")), activation: str = "silu",
                 decode_time_step_limit: tuple[float, float] | None = None,
                 gated_norm: bool = True, norm_before_gate: bool = False, norm_in_float32: bool = False,
                 out_proj_bias: bool | None = None, proj_multipliers: tuple[float, ...] | None = None) -> None:
        """``decode_time_step_limit``: the dt clamp of the single-token update, when it differs from the
        scan's ``time_step_limit`` (mamba_ssm's and HF's step/recurrent path never clamp dt, so models
        mirroring them pass ``(0.0, inf)``); ``None`` uses ``time_step_limit`` for both."""
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.head_dim, self.d_state, self.n_groups = num_heads, head_dim, d_state, n_groups
        self.intermediate = intermediate_size if intermediate_size is not None else num_heads * head_dim
        self.conv_dim = mamba2_conv_dim(self.intermediate, n_groups, d_state)
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        limit = time_step_limit if decode_time_step_limit is None else decode_time_step_limit
        self.decode_time_step_limit = (float(limit[0]), float(limit[1]))
        self.activation = activation
        self.norm_before_gate, self.norm_in_float32 = norm_before_gate, norm_in_float32
        if proj_multipliers is not None and len(proj_multipliers) != 5:
            raise ValueError(f"proj_multipliers needs 5 values (gate, x, B, C, dt), got {proj_multipliers}")
        self.proj_multipliers = None if proj_multipliers is None else tuple(float(m) for m in proj_multipliers)
        self.in_proj = nn.Linear(hidden_size, self.intermediate + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = (GatedRMSNorm(self.intermediate, norm_group_size or self.intermediate // n_groups, norm_eps)
                     if gated_norm else None)
        self.out_proj = nn.Linear(self.intermediate, hidden_size,
                                  bias=proj_bias if out_proj_bias is None else out_proj_bias)
        if self.proj_multipliers is not None:
            self.register_buffer("proj_scale", torch.empty(self.in_proj.out_features), persistent=False)
            self.reset_buffers()
        self.spec = mamba2_spec(layer_index, dtypes, intermediate=self.intermediate, n_groups=n_groups,
                                d_state=d_state, conv_kernel=conv_kernel, num_heads=num_heads, head_dim=head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        cache = batch.caches[self.layer_index]
        conv_states, ssm_states = cache.state["conv"], cache.state["ssm"]
        proj = self.in_proj(x)  # (T, inter + conv_dim + H)
        if self.proj_multipliers is not None:  # proj * proj_scale.to(dtype), the scales cast once
            key = (self.proj_scale.data_ptr(), proj.dtype)
            if getattr(self, "_proj_scale_key", None) != key:
                self._proj_scale_cast, self._proj_scale_key = self.proj_scale.to(proj.dtype), key
            proj = scale(proj, self._proj_scale_cast)
        gate, xbc, dt = torch.split(proj, [self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        H, P = self.num_heads, self.head_dim
        y = torch.empty(x.shape[0], H, P, dtype=torch.float32, device=x.device)  # (T, H, P)
        if batch.decode is not None:
            self._scan_group(batch.decode, xbc, dt, y, conv_states, ssm_states, decode=True)
        if batch.prefill is not None:
            self._scan_group(batch.prefill, xbc, dt, y, conv_states, ssm_states, decode=False)
        return self.out_proj(self._gate_and_norm(y.reshape(x.shape[0], -1), gate, x.dtype))  # (T, hidden)

    def _scan_group(self, g, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor, conv_states: torch.Tensor,
                    ssm_states: torch.Tensor, decode: bool) -> None:
        """Conv + SSM scan of one sequence group; writes y[g.tokens] (float32) and the group's state slots.

        xbc: (T, conv_dim), dt: (T, H), y: (T, H, P) float32.
        """
        if not decode and g.num_generated and self.decode_time_step_limit != self.time_step_limit:
            if g.num_generated < g.num_seqs:  # generated tokens get the decode rule, prompt chunks the scan's
                generated, prompts = g.split(g.num_generated)
                self._scan_group(generated, xbc, dt, y, conv_states, ssm_states, decode=False)
                self._scan_group(prompts, xbc, dt, y, conv_states, ssm_states, decode=False)
                return
            decode_rule = True
        else:
            decode_rule = decode
        dt_limit = self.decode_time_step_limit if decode_rule else self.time_step_limit
        mamba2_conv_scan(self, g, xbc, dt, y, conv_states, ssm_states, decode=decode, dt_limit=dt_limit)

    def _gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y: (T, inter) float32 scan output, gate: (T, inter) -> (T, inter) in ``dtype``."""
        return gate_and_norm(y, gate, self.norm, dtype, norm_before_gate=self.norm_before_gate,
                             norm_in_float32=self.norm_in_float32)

    def reset_buffers(self) -> None:
        """Recompute the in_proj segment scales (gate, x, B, C, dt) after meta construction."""
        if self.proj_multipliers is None:
            return
        G, N = self.n_groups, self.d_state
        sizes = (self.intermediate, self.intermediate, G * N, G * N, self.num_heads)
        scale = torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, self.proj_multipliers)])
        self.proj_scale = scale.to(self.proj_scale.device)
