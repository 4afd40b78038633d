"""Feed-forward blocks: gated MLP and a plain (non-gated) MLP."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from hybridserve.kernels import pointwise as pointwise_kernels


class ActAndMul(nn.Module):
    """``act(gate) * up``, each op rounded to the activation dtype as in PyTorch (silu has a CPU kernel)."""

    use_cpu_kernels = False  # set by the engine when the compiled CPU kernels are on and available

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = act
        self.act_fn = ACT2FN[act]

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: (T, I) -> (T, I)."""
        if self.use_cpu_kernels and self.act == "silu":
            out = pointwise_kernels.silu_mul(gate, up)
            if out is not None:
                return out
        return self.act_fn(gate) * up

    def emit(self, program, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``out = act(gate) * up`` (each (rows, I)) to a decode program (``kernels.program.ProgramBuilder``)."""
        from hybridserve.kernels.program import Step, Unsupported

        if not self.use_cpu_kernels or self.act != "silu" or not (gate.dtype == up.dtype == out.dtype):
            raise Unsupported(f"the {self.act} activation has no CPU kernel (silu only)")
        (g_ptr, g_s), (u_ptr, u_s), (o_ptr, o_s) = program.rows(gate), program.rows(up), program.rows(out)
        program.call("hs_silu_mul", [program.dtype_code(gate.dtype), Step.ROWS, gate.shape[1], g_ptr, g_s, u_ptr, u_s,
                                     o_ptr, o_s])


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with separate gate/up projections (HF naming)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_and_mul = ActAndMul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))

    def emit_decode(self, program, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add this MLP (x (rows, hidden) -> out (rows, hidden)) to a decode program."""
        from hybridserve.layers.packed_linear import emit_linear

        inter = self.gate_proj.out_features
        gate_up = program.scratch("mlp.gate_up", 2 * inter, x.dtype)  # (rows, 2 I): [gate, up]
        act = program.scratch("mlp.act", inter, x.dtype)  # (rows, I)
        emit_linear(program, self.gate_proj, x, gate_up[:, :inter])
        emit_linear(program, self.up_proj, x, gate_up[:, inter:])
        self.act_and_mul.emit(program, gate_up[:, :inter], gate_up[:, inter:], act)
        emit_linear(program, self.down_proj, act, out)


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` (Nemotron-H uses relu^2 here)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))
