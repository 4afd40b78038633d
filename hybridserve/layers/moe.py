"""Mixture-of-experts building blocks with HF 5's fused expert weights.

Experts are stored as 3-D parameters (HF names): gated experts ``gate_up_proj (E, 2I, H)`` and
``down_proj (E, H, I)``; non-gated experts ``up_proj (E, I, H)`` and ``down_proj (E, H, I)``.
Routers differ per family and live with their model; they produce ``(topk_index, topk_weight)``.
Checkpoints often store the experts one by one instead; ``stack_expert_weights`` fuses them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from hybridserve.kernels import fallbacks, gemm, linear_w4, linear_w8
from hybridserve.layers.activations import activation
from hybridserve.ops.linear_w4 import linear_w4_ref
from hybridserve.ops.linear_w8 import linear_w8_ref


def softmax_topk(router_logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax over experts. router_logits: (T, E) -> index (T, k), weight (T, k) float32."""
    probs = router_logits.float().softmax(-1)  # (T, E)
    weight, index = probs.topk(k, dim=-1)
    if normalize:
        weight = weight / weight.sum(-1, keepdim=True)
    return index, weight


#: the fused parameters of gated experts and the per-expert projections stacked into each, in order
GATED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def stack_expert_weights(weights: dict[str, torch.Tensor], experts: str,
                         fused: dict[str, tuple[str, ...]] = GATED_EXPERTS) -> dict[str, torch.Tensor]:
    r"""Fuse per-expert checkpoint weights into the 3-D parameters of ``FusedExperts``.

    ``experts`` is a regex for the module path of an experts block (e.g. ``r".*\.mlp\.experts"``); a
    per-expert weight is ``{that path}.{e}.{projection}.weight``, (out, in) each. ``fused`` maps every
    fused parameter name to the projections it holds: their experts are stacked, (E, out, in), and
    several projections are concatenated along ``out`` in the order given (``gate_up_proj`` = gate rows,
    then up rows, as HF's conversion does). All other names, already fused weights included, pass
    through unchanged. Every projection of a block must have experts 0..E-1 (a ValueError names the
    missing weights).
    """
    projections = [p for parts in fused.values() for p in parts]
    alternatives = "|".join(map(re.escape, projections))
    pattern = re.compile(rf"^(?P<prefix>{experts})\.(?P<e>\d+)\.(?P<proj>{alternatives})\.weight$")
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[tuple[str, int], torch.Tensor]] = {}  # prefix -> (projection, expert) -> W
    for name, tensor in weights.items():
        m = pattern.match(name)
        if m is None:
            out[name] = tensor
        else:
            blocks.setdefault(m["prefix"], {})[(m["proj"], int(m["e"]))] = tensor
    for prefix, parts in blocks.items():
        n = 1 + max(e for _, e in parts)
        missing = [f"{prefix}.{e}.{p}.weight" for e in range(n) for p in projections if (p, e) not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks expert weights {missing[:10]}")
        for param, projs in fused.items():
            stacked = [torch.stack([parts[(p, e)] for e in range(n)]) for p in projs]  # (E, out, in) each
            out[f"{prefix}.{param}"] = stacked[0] if len(stacked) == 1 else torch.cat(stacked, dim=1)
    return out


class FusedExperts(nn.Module):
    """E experts applied to the tokens routed to them, weighted and summed per token."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str, gated: bool = True,
                 input_size: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.gated = num_experts, gated
        d_in = input_size or hidden_size
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, d_in))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, d_in))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_in, intermediate_size))
        self.act, self.act_fn = act, activation(act)
        self.intermediate_size = intermediate_size
        self.packed: dict[str, list[torch.Tensor]] | None = None  # parameter name -> packed weight per expert
        self.tables: dict[str, torch.Tensor] = {}  # parameter name -> (E,) int64 addresses of the packed weights
        self._out_features: dict[str, int] = {}
        self._in_features: dict[str, int] = {}
        # the packed weights' codes: int8 (8-bit), uint4 (4-bit, kernels/linear_w4.py), None: 16/32-bit
        self.weight_format: torch.dtype | None = None
        self.group = 0  # in-features per scale of 8-bit weights (0: one scale per output channel)

    def _projections(self) -> tuple[str, ...]:
        return ("gate_up_proj" if self.gated else "up_proj", "down_proj")

    def packable(self) -> bool:
        """Whether the CPU linear kernels take every expert weight (bf16/fp16 on the CPU)."""
        return self.packed is None and all(gemm.packable(w) for w in self.expert_weights())

    def expert_weights(self) -> list[torch.Tensor]:
        """Every expert's (out, in) weight of every projection."""
        return [getattr(self, name)[e] for name in self._projections() for e in range(self.num_experts)]

    def pack(self, pack_weight, weight_format: torch.dtype | None = None, group: int = 0) -> int:
        """Hold the experts only in the CPU kernels' packed form, ``pack_weight(weight)`` each (a weight
        it declines keeps the whole block unpacked): 16/32-bit packs, or, with ``weight_format`` int8, 8-bit codes
        with scales per ``group`` in-features (0: per output channel), or uint4, 4-bit centred codes with a
        sub-scaled scale per ``group`` in-features (``kernels/linear_w4.py``). Returns how many experts'
        projections were packed."""
        packed = {name: [pack_weight(getattr(self, name)[e].detach()) for e in range(self.num_experts)]
                  for name in self._projections()}
        if any(p is None for ps in packed.values() for p in ps):
            return 0
        for name in self._projections():
            param = getattr(self, name)
            self._out_features[name], self._in_features[name] = param.shape[1], param.shape[2]
            setattr(self, name, nn.Parameter(param.new_empty(0, *param.shape[1:]), requires_grad=False))
        self.packed, self.weight_format, self.group = packed, weight_format, group
        self.tables = {name: torch.tensor([w.data_ptr() for w in ws], dtype=torch.int64) for name, ws in packed.items()}
        return sum(len(ps) for ps in packed.values())

    def _linear(self, h: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """h (n, in) through projection ``name`` of expert e -> (n, out)."""
        if self.packed is None:
            return nn.functional.linear(h, getattr(self, name)[e])
        if self.weight_format == linear_w4.INT4_FORMAT:  # 4-bit codes, centred, a sub-scaled scale per group
            packed, n_out = self.packed[name][e], self._out_features[name]
            y = linear_w4.linear(h, packed, n_out, self.group, False, None, sub_scaled=True)
            if y is None:
                codes, scales, _ = linear_w4.unpack(packed, n_out, self._in_features[name], self.group, False, True)
                y = linear_w4_ref(h, codes, scales, None, self.group)
            return y
        if self.weight_format is not None:
            args = (self.packed[name][e], self._out_features[name], self.weight_format, self.group)
            y = linear_w8.linear(h, *args, None)
            if y is None:
                q, s = linear_w8.unpack(args[0], args[1], self._in_features[name], self.weight_format, self.group)
                y = linear_w8_ref(h, q, s, self.group)
            return y
        y = gemm.linear(h, self.packed[name][e], self._out_features[name], None)
        if y is None:
            raise TypeError(f"packed experts take {self.packed[name][e].dtype} CPU input, got {h.dtype} on {h.device}")
        return y

    def forward(self, x: torch.Tensor, topk_index: torch.Tensor, topk_weight: torch.Tensor,
                shared: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, H); topk_index, topk_weight: (T, k) -> (T, H) in x's dtype, plus ``shared`` (T, H)
        when given (a shared expert's output, added after the rounding)."""
        if self.packed is not None:  # packed for the CPU kernels: one call for the whole block
            up, down = self._projections()
            out = gemm.moe_experts(x, topk_index, topk_weight, self.tables[up], self.tables[down],
                                   self.intermediate_size, self.gated, self.act, shared, self.weight_format, self.group)
            if out is not None:
                return out
            fallbacks.record("moe_experts", f"{self.act}, " + fallbacks.describe(x, topk_weight))
        out = self._forward_torch(x, topk_index, topk_weight)
        return out if shared is None else out + shared

    def _forward_torch(self, x: torch.Tensor, topk_index: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """The experts one at a time, over the tokens routed to each."""
        out = torch.zeros(x.shape[0], self.down_proj.shape[1], dtype=torch.float32, device=x.device)  # (T, H)
        flat_expert = topk_index.reshape(-1)  # (T*k,)
        order = flat_expert.argsort(stable=True)
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        token_of = (order // topk_index.shape[1])  # (T*k,) token of each sorted assignment
        weight_of = topk_weight.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            h = x[rows]  # (n, H)
            if self.gated:
                gate, up = self._linear(h, "gate_up_proj", e).chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            else:
                h = self.act_fn(self._linear(h, "up_proj", e))
            h = self._linear(h, "down_proj", e)  # (n, H)
            out.index_add_(0, rows, h.float() * weight_of[start:start + n, None].float())
            start += n
        return out.to(x.dtype)
