"""The Mamba2 mixer (SSD) over the pooled conv and SSM state."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.cache.slots import read_slots, write_slots
from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.kernels import recurrent as recurrent_kernels
from hybridserve.layers.norms import GatedRMSNorm
from hybridserve.layers.state_shapes import mamba2_conv_dim, mamba2_spec
from hybridserve.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from hybridserve.ops.dispatch import call
from hybridserve.ops.elementwise import scale
from hybridserve.ops.ssd import mamba2_chunk_scan_varlen, mamba2_state_update


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
        args = (g, xbc, dt, y, conv_states, ssm_states, decode, dt_limit)
        call("mamba2_conv_scan", lambda: self._scan_kernels(*args), lambda: self._scan_plain(*args), xbc, ssm_states)

    def _scan_kernels(self, g, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor, conv_states: torch.Tensor,
                      ssm_states: torch.Tensor, decode: bool, dt_limit: tuple[float, float]) -> bool:
        """The CPU-kernel body of :meth:`_scan_group`; False when declined before any state changed."""
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        n, idx = g.num_tokens, g.state_indices
        if not recurrent_kernels.scan_state_supported(ssm_states, xbc.dtype):
            return False
        conv_w, conv_b, A32, D32, dt_bias32 = self._kernel_params()
        conv_out = recurrent_kernels.causal_conv1d(xbc[g.tokens], conv_states, conv_w, conv_b, g.cu_seqlens_q, idx,
                                                   self.activation)  # (n, conv_dim)
        if conv_out is None:
            return False
        xs, B, C = torch.split(conv_out, [self.intermediate, G * N, G * N], dim=-1)
        if recurrent_kernels.mamba2_scan(ssm_states, xs, dt[g.tokens], A32, B, C, D32, dt_bias32, True,
                                         dt_limit, g.cu_seqlens_q, idx, y[g.tokens].view(n, H * P)):
            return True
        # the state was checked above and the other arguments are built here: a decline is a bug
        raise RuntimeError("the CPU conv kernel ran but the scan kernel declined the same group")

    def _scan_plain(self, g, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor, conv_states: torch.Tensor,
                    ssm_states: torch.Tensor, decode: bool, dt_limit: tuple[float, float]) -> bool:
        """The PyTorch body of :meth:`_scan_group` (``ops/causal_conv1d.py``, ``ops/ssd.py``)."""
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        n, idx = g.num_tokens, g.state_indices
        weight = self.conv1d.weight.squeeze(1)  # (conv_dim, K)
        A = -torch.exp(self.A_log.float())  # (H,)
        if decode:
            conv_out = causal_conv1d_update(xbc[g.tokens], conv_states, weight, self.conv1d.bias, idx,
                                            self.activation)  # (n, conv_dim)
            xs, B, C = torch.split(conv_out, [self.intermediate, G * N, G * N], dim=-1)
            y[g.tokens] = mamba2_state_update(
                ssm_states, xs.reshape(n, H, P), dt[g.tokens], A, B.reshape(n, G, N), C.reshape(n, G, N),
                self.D, self.dt_bias, True, dt_limit, idx)
            return True
        conv_out, conv_final = causal_conv1d_varlen(xbc[g.tokens], weight, self.conv1d.bias, g.cu_seqlens_q,
                                                    read_slots(conv_states, idx), self.activation)
        write_slots(conv_states, idx, conv_final)
        xs, B, C = torch.split(conv_out, [self.intermediate, G * N, G * N], dim=-1)
        y_p, ssm_final = mamba2_chunk_scan_varlen(
            xs.reshape(n, H, P), dt[g.tokens], A, B.reshape(n, G, N), C.reshape(n, G, N), self.chunk_size,
            self.D, self.dt_bias, True, dt_limit, g.cu_seqlens_q, read_slots(ssm_states, idx))
        write_slots(ssm_states, idx, ssm_final)
        y[g.tokens] = y_p
        return True

    def _kernel_params(self) -> tuple[torch.Tensor, ...]:
        """The float32 parameters the CPU kernels take: conv weight (K, conv_dim) tap-major, conv bias or
        None, A = -exp(A_log), D, dt_bias (each (H,)); cached, rebuilt when a parameter's storage changes."""
        params = (self.conv1d.weight, self.conv1d.bias, self.A_log, self.D, self.dt_bias)
        key = tuple(None if p is None else p.data_ptr() for p in params)
        if getattr(self, "_kernel_params_key", None) != key:
            bias = self.conv1d.bias
            self._kernel_params_cache = (
                recurrent_kernels.tap_major(self.conv1d.weight),  # (K, conv_dim)
                None if bias is None else bias.detach().float().contiguous(),
                -torch.exp(self.A_log.detach().float()), self.D.detach().float().contiguous(),
                self.dt_bias.detach().float().contiguous())
            self._kernel_params_key = key
        return self._kernel_params_cache

    def _gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y: (T, inter) float32 scan output, gate: (T, inter) -> (T, inter) in ``dtype``."""
        return call("silu_gate" if self.norm is None else "gated_rms_norm",
                    lambda: self._gate_and_norm_kernels(y, gate, dtype),
                    lambda: self._gate_and_norm_plain(y, gate, dtype), y, gate)

    def _gate_and_norm_kernels(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The CPU-kernel body of :meth:`_gate_and_norm` (None: declined)."""
        if gate.dtype != dtype:
            return None
        if self.norm is None:
            return pointwise_kernels.silu_gate(y, gate)
        return pointwise_kernels.gated_rms_norm(y, gate, self.norm.weight, self.norm.group_size, self.norm.eps,
                                                self.norm_in_float32, self.norm_before_gate)

    def _gate_and_norm_plain(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The PyTorch body of :meth:`_gate_and_norm`."""
        if self.norm is None:
            return (y * nn.functional.silu(gate)).to(dtype)
        if self.norm_before_gate:
            return (self.norm(y, None) * nn.functional.silu(gate.float())).to(dtype)
        if self.norm_in_float32:
            return self.norm(y, gate).to(dtype)
        return self.norm(y.to(dtype), gate)

    def reset_buffers(self) -> None:
        """Recompute the in_proj segment scales (gate, x, B, C, dt) after meta construction."""
        if self.proj_multipliers is None:
            return
        G, N = self.n_groups, self.d_state
        sizes = (self.intermediate, self.intermediate, G * N, G * N, self.num_heads)
        scale = torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, self.proj_multipliers)])
        self.proj_scale = scale.to(self.proj_scale.device)
