"""Megatron-style sharding of a model built on the meta device, before its weights load.

Each sharded layer gets per-rank parameter shapes, its attributes and cache spec rewritten to the rank's
slice (heads, groups, channels), and a slicer per parameter that cuts the rank's part out of the full
checkpoint tensor (``model.tp_slicers``, applied by the loader). Column-parallel projections keep their
rows of each fused segment; row-parallel projections keep their columns, their bias on rank 0 only, and
the layer's output is summed over the ranks (a forward hook). Embedding and LM head hold a slice of the
vocabulary (padded to a multiple of the ranks); the logits are gathered by :func:`gather_logits`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from hybridserve.distributed.group import TPGroup
from hybridserve.distributed.layers import (
    HeadSliceLightningAttention,
    RowParallelLinear,
    SpanningNormMamba2Mixer,
    SpanningRMSNorm,
    VocabParallelEmbedding,
)
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.gated_deltanet import GatedDeltaNet
from hybridserve.layers.mamba1 import Mamba1Mixer
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.mlp import GatedMLP, PlainMLP
from hybridserve.layers.moe import FusedExperts

Slicer = Callable[[torch.Tensor], torch.Tensor]
Segment = tuple[int, int]  # (start, size) along one dimension of the full tensor

#: architectures whose every layer is sharded here (any other is refused)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM",
                           "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "Qwen3NextForCausalLM",
                           "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                           "Qwen3_5MoeForConditionalGeneration", "FalconH1ForCausalLM", "Zamba2ForCausalLM",
                           "MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM",
                           "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM",
                           "MiniMaxForCausalLM", "OlmoHybridForCausalLM", "KimiLinearForCausalLM",
                           "xLSTMForCausalLM")


def check_supported(architecture: str, world: int) -> None:
    """ValueError unless ``architecture`` can run on ``world`` > 1 tensor-parallel ranks."""
    if world > 1 and architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"tensor parallel is not supported for {architecture} yet (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}); run it with tensor_parallel_size=1")


def _even(what: str, count: int, world: int) -> int:
    if count % world:
        raise ValueError(f"{what}={count} is not divisible by tensor_parallel_size={world}")
    return count // world


def _segments(dim: int, segments: list[Segment], pad_to: int | None = None) -> Slicer:
    """The concatenation of ``segments`` of ``dim``, zero-padded along it to ``pad_to``."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        parts = [t.narrow(dim, start, size) for start, size in segments if size > 0]
        out = torch.cat(parts, dim=dim) if len(parts) != 1 else parts[0]
        if pad_to is not None and out.shape[dim] < pad_to:
            shape = list(out.shape)
            shape[dim] = pad_to - out.shape[dim]
            out = torch.cat([out, out.new_zeros(shape)], dim=dim)
        return out.contiguous()
    return cut


def _rank0_only(rank: int) -> Slicer:
    """A row-parallel bias: whole on rank 0, zeros elsewhere (the ranks' outputs are summed)."""
    return (lambda t: t) if rank == 0 else torch.zeros_like


class Sharder:
    """Shards one model's modules for ``group``'s rank, collecting the slicers by parameter name."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.rank, self.world = group.rank, group.world
        self.slicers: dict[str, Slicer] = {}

    # ---------------------------------------------------------------- helpers
    def param(self, prefix: str, module: nn.Module, name: str, shape: tuple[int, ...], slicer: Slicer) -> None:
        """Give ``module.name`` the per-rank ``shape`` (on meta) and record how to cut it from the checkpoint."""
        old = getattr(module, name)
        module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device),
                                                requires_grad=False)
        self.slicers[f"{prefix}{name}"] = slicer

    def column(self, prefix: str, linear: nn.Linear, segments: list[Segment]) -> None:
        """Keep output rows ``segments`` of ``linear`` (and of its bias)."""
        rows = sum(size for _, size in segments)
        self.param(prefix, linear, "weight", (rows, linear.in_features), _segments(0, segments))
        if linear.bias is not None:
            self.param(prefix, linear, "bias", (rows,), _segments(0, segments))
        linear.out_features = rows

    def row(self, prefix: str, linear: nn.Linear, segment: Segment) -> None:
        """Keep input columns ``segment`` of ``linear``; its bias on rank 0 only."""
        self.param(prefix, linear, "weight", (linear.out_features, segment[1]), _segments(1, [segment]))
        if linear.bias is not None:
            self.param(prefix, linear, "bias", tuple(linear.bias.shape), _rank0_only(self.rank))
        linear.in_features = segment[1]

    def reduce_output(self, module: nn.Module) -> None:
        """Sum ``module``'s output over the ranks (its row-parallel projection gave partial sums)."""
        group = self.group
        module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))

    def share(self, n: int) -> Segment:
        """This rank's (start, size) of ``n`` evenly split items."""
        size = n // self.world
        return self.rank * size, size

    # ----------------------------------------------------------------- layers
    def attention(self, prefix: str, m: Attention) -> None:
        heads = _even("num_attention_heads", m.num_heads, self.world)
        kv = m.num_kv_heads
        if kv % self.world == 0:
            kv_local, kv_start = kv // self.world, self.rank * (kv // self.world)
        elif self.world % kv == 0:  # fewer KV heads than ranks: each rank keeps (a copy of) the one its heads use
            kv_local, kv_start = 1, self.rank // (self.world // kv)
        else:
            raise ValueError(f"num_key_value_heads={kv} neither divides nor is divisible by "
                             f"tensor_parallel_size={self.world} (num_attention_heads={m.num_heads})")
        dh = m.head_dim
        per_head = dh * (2 if getattr(m, "output_gate", False) else 1)
        q_rows, kv_rows = [(self.rank * heads * per_head, heads * per_head)], [(kv_start * dh, kv_local * dh)]
        self.column(f"{prefix}q_proj.", m.q_proj, q_rows)
        self.column(f"{prefix}k_proj.", m.k_proj, kv_rows)
        self.column(f"{prefix}v_proj.", m.v_proj, kv_rows)
        if getattr(m, "head_gate", False):
            self.column(f"{prefix}g_proj.", m.g_proj, [(self.rank * heads, heads)])
        if getattr(m, "use_adapter", False):  # Zamba2's per-use low-rank adapters, added to q, k and v
            for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                self.adapters(f"{prefix}linear_{name}_adapter_list.", getattr(m, f"linear_{name}_adapter_list"), rows)
        self.row(f"{prefix}o_proj.", m.o_proj, (self.rank * heads * dh, heads * dh))
        m.num_heads, m.num_kv_heads = heads, kv_local
        m.spec = dataclasses.replace(m.spec, attention=dataclasses.replace(m.spec.attention, num_kv_heads=kv_local))
        self.reduce_output(m)

    def whole_projection_norm_attention(self, prefix: str, m: Attention) -> None:
        """OLMo-3's attention: q/k norms over all heads' projections, spanning the ranks."""
        kv, world = m.num_kv_heads, self.world
        if kv % world:
            raise ValueError(f"num_key_value_heads={kv} is not divisible by tensor_parallel_size={world} (its k "
                             "norm spans every KV head)")
        q_rows = [(self.rank * (m.num_heads // world) * m.head_dim, m.num_heads // world * m.head_dim)]
        kv_rows = [(self.rank * (kv // world) * m.head_dim, kv // world * m.head_dim)]
        self.attention(prefix, m)
        self.spanning_norm(f"{prefix}q_norm.", m.q_norm, q_rows)
        self.spanning_norm(f"{prefix}k_norm.", m.k_norm, kv_rows)

    def adapters(self, prefix: str, adapters: nn.ModuleList, rows: list[Segment]) -> None:
        """Low-rank adapters (``Sequential(down, up)`` per use) added to a column-parallel output: ``up``
        keeps the same rows, ``down`` stays whole."""
        for i, adapter in enumerate(adapters):
            if isinstance(adapter, nn.Sequential):
                self.column(f"{prefix}{i}.1.", adapter[1], rows)

    def zamba2_mlp(self, prefix: str, m: nn.Module) -> None:
        """Zamba2's MLP: ``gate_up_proj`` (and its adapters) yields ``[gate | up]``."""
        inter = _even("intermediate_size", m.down_proj.in_features, self.world) * self.world
        start, size = self.share(inter)
        rows = [(start, size), (inter + start, size)]
        self.column(f"{prefix}gate_up_proj.", m.gate_up_proj, rows)
        self.adapters(f"{prefix}gate_up_proj_adapter_list.", m.gate_up_proj_adapter_list, rows)
        self.row(f"{prefix}down_proj.", m.down_proj, (start, size))
        self.reduce_output(m)

    def gated_mlp(self, prefix: str, m: GatedMLP) -> None:
        inter = m.gate_proj.out_features
        _even("intermediate_size", inter, self.world)
        share = self.share(inter)
        self.column(f"{prefix}gate_proj.", m.gate_proj, [share])
        self.column(f"{prefix}up_proj.", m.up_proj, [share])
        self.row(f"{prefix}down_proj.", m.down_proj, share)
        self.reduce_output(m)

    def plain_mlp(self, prefix: str, m: PlainMLP) -> None:
        inter = m.up_proj.out_features
        _even("intermediate_size", inter, self.world)
        share = self.share(inter)
        self.column(f"{prefix}up_proj.", m.up_proj, [share])
        self.row(f"{prefix}down_proj.", m.down_proj, share)
        self.reduce_output(m)

    def fused_gate_up_mlp(self, prefix: str, m: nn.Module, up: str, down: str) -> None:
        """An MLP whose ``up`` projection yields ``[gate | up]`` (Granite-4.0-H's shared MLP)."""
        up_linear, down_linear = getattr(m, up), getattr(m, down)
        inter = _even("shared_intermediate_size", up_linear.out_features // 2, self.world) * self.world
        start, size = self.share(inter)
        self.column(f"{prefix}{up}.", up_linear, [(start, size), (inter + start, size)])
        self.row(f"{prefix}{down}.", down_linear, (start, size))
        self.reduce_output(m)

    def experts(self, prefix: str, m: FusedExperts) -> None:
        """Every expert keeps its slice of the intermediate channels; a shared expert's output (already
        summed) is added on rank 0 only."""
        inter = m.intermediate_size
        _even("moe_intermediate_size", inter, self.world)
        start, size = self.share(inter)
        e, d_in = m.down_proj.shape[0], m.down_proj.shape[1]
        if m.gated:
            rows = [(start, size), (inter + start, size)]  # gate rows, then up rows
            self.param(prefix, m, "gate_up_proj", (e, 2 * size, d_in), _segments(1, rows))
        else:
            self.param(prefix, m, "up_proj", (e, size, d_in), _segments(1, [(start, size)]))
        self.param(prefix, m, "down_proj", (e, d_in, size), _segments(2, [(start, size)]))
        m.intermediate_size = size
        if self.rank != 0:
            m.register_forward_pre_hook(_drop_shared, with_kwargs=True)
        self.reduce_output(m)

    def mamba2(self, prefix: str, m: Mamba2Mixer) -> None:
        w, r = self.world, self.rank
        H, G, N, inter = m.num_heads, m.n_groups, m.d_state, m.intermediate
        heads = _even("mamba num_heads", H, w)
        inter_l = _even("mamba intermediate_size", inter, w)
        if G % w == 0:
            groups, g_start = G // w, r * (G // w)
        elif w % G == 0:  # fewer groups than ranks: each rank keeps (a copy of) the group its heads read
            groups, g_start = 1, r // (w // G)
            if m.norm is not None and m.norm.group_size > inter_l:  # the norm's group spans w / G ranks
                if m.norm.group_size != inter // G:
                    raise ValueError(f"mamba norm groups of {m.norm.group_size} channels (n_groups={G}) cannot be "
                                     f"split over tensor_parallel_size={w}")
                m.__class__ = SpanningNormMamba2Mixer
                m.group, m.norm_group, m.norm_groups, m.norm_group_size = self.group, g_start, G, m.norm.group_size
        else:
            raise ValueError(f"mamba n_groups={G} neither divides nor is divisible by tensor_parallel_size={w}")
        x_seg = (r * inter_l, inter_l)
        b_seg, c_seg = (g_start * N, groups * N), (G * N + g_start * N, groups * N)
        proj = [x_seg, (inter + x_seg[0], inter_l), (2 * inter + b_seg[0], b_seg[1]), (2 * inter + c_seg[0], c_seg[1]),
                (2 * inter + 2 * G * N + r * heads, heads)]
        self.column(f"{prefix}in_proj.", m.in_proj, proj)
        conv = [x_seg, (inter + b_seg[0], b_seg[1]), (inter + c_seg[0], c_seg[1])]
        conv_dim = inter_l + 2 * groups * N
        k = m.conv1d.weight.shape[-1]
        self.param(f"{prefix}conv1d.", m.conv1d, "weight", (conv_dim, 1, k), _segments(0, conv))
        if m.conv1d.bias is not None:
            self.param(f"{prefix}conv1d.", m.conv1d, "bias", (conv_dim,), _segments(0, conv))
        m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = conv_dim
        for name in ("dt_bias", "A_log", "D"):
            self.param(prefix, m, name, (heads,), _segments(0, [(r * heads, heads)]))
        if m.norm is not None:
            self.param(f"{prefix}norm.", m.norm, "weight", (inter_l,), _segments(0, [x_seg]))
        self.row(f"{prefix}out_proj.", m.out_proj, x_seg)
        m.num_heads, m.n_groups, m.intermediate, m.conv_dim = heads, groups, inter_l, conv_dim
        if m.proj_multipliers is not None:
            m.proj_scale = torch.empty(m.in_proj.out_features, device=m.proj_scale.device)
        shapes = {"conv": (conv_dim, k - 1), "ssm": (heads, m.head_dim, N)}
        m.spec = dataclasses.replace(m.spec, state=tuple(dataclasses.replace(s, shape=shapes[s.name])
                                                          for s in m.spec.state))
        self.reduce_output(m)

    def mamba1(self, prefix: str, m: Mamba1Mixer) -> None:
        """Channels split over the ranks; ``x_proj`` (dt, B, C from every channel) sums its partial outputs."""
        inter = m.intermediate
        _even("mamba intermediate_size", inter, self.world)
        start, size = self.share(inter)
        self.column(f"{prefix}in_proj.", m.in_proj, [(start, size), (inter + start, size)])
        k = m.conv1d.weight.shape[-1]
        self.param(f"{prefix}conv1d.", m.conv1d, "weight", (size, 1, k), _segments(0, [(start, size)]))
        if m.conv1d.bias is not None:
            self.param(f"{prefix}conv1d.", m.conv1d, "bias", (size,), _segments(0, [(start, size)]))
        m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = size
        self.param(f"{prefix}x_proj.", m.x_proj, "weight", (m.x_proj.out_features, size), _segments(1, [(start, size)]))
        m.x_proj.in_features = size
        m.x_proj.__class__ = RowParallelLinear
        m.x_proj.group = self.group
        self.column(f"{prefix}dt_proj.", m.dt_proj, [(start, size)])
        self.param(prefix, m, "A_log", (size, m.d_state), _segments(0, [(start, size)]))
        self.param(prefix, m, "D", (size,), _segments(0, [(start, size)]))
        self.row(f"{prefix}out_proj.", m.out_proj, (start, size))
        m.intermediate = size
        shapes = {"conv": (size, k - 1), "ssm": (size, m.d_state)}
        m.spec = dataclasses.replace(m.spec, state=tuple(dataclasses.replace(s, shape=shapes[s.name])
                                                          for s in m.spec.state))
        self.reduce_output(m)

    def spanning_norm(self, prefix: str, norm: nn.Module, segments: list[Segment]) -> None:
        """An RMS norm over a width the ranks split: keep ``segments`` of its weight, sum the squares over ranks."""
        full = norm.weight.shape[0]
        self.param(f"{prefix}", norm, "weight", (sum(n for _, n in segments),), _segments(0, segments))
        norm.__class__ = spanning_class(type(norm))
        norm.group, norm.full_width = self.group, full

    def lightning_attention(self, prefix: str, m: nn.Module) -> None:
        """MiniMax's linear attention: heads split (``qkv_proj`` per head ``[q | k | v]``), the norm over all
        heads spanning ranks, each head keeping its own decay rate."""
        heads = _even("num_attention_heads", m.num_heads, self.world)
        start, D = self.rank * heads, m.head_dim
        self.column(f"{prefix}qkv_proj.", m.qkv_proj, [(start * 3 * D, heads * 3 * D)])
        self.column(f"{prefix}output_gate.", m.output_gate, [(start * D, heads * D)])
        self.spanning_norm(f"{prefix}norm.", m.norm, [(start * D, heads * D)])
        self.row(f"{prefix}out_proj.", m.out_proj, (start * D, heads * D))
        m.slope_rate = torch.empty(heads, device=m.slope_rate.device)
        m.__class__ = HeadSliceLightningAttention
        m.total_heads, m.head_start, m.num_heads = m.num_heads, start, heads
        m.spec = dataclasses.replace(m.spec, state=tuple(dataclasses.replace(s, shape=(heads, D, D))
                                                          for s in m.spec.state))
        self.reduce_output(m)

    def kda(self, prefix: str, m: nn.Module) -> None:
        """Kimi delta attention: heads split (q, k, v, the conv over ``[q | k | v]``, the forget gate's
        per-channel output, beta, the output gate); the low-rank inputs of the gates stay whole."""
        heads = _even("linear_num_heads", m.num_heads, self.world)
        start, D, qkv = self.rank * heads, m.head_dim, m.qkv_dim
        rows = [(start * D, heads * D)]
        for name in ("q_proj", "k_proj", "v_proj"):
            self.column(f"{prefix}{name}.", getattr(m, name), rows)
        conv = [(i * qkv + start * D, heads * D) for i in range(3)]
        k = m.conv1d.weight.shape[-1]
        self.param(f"{prefix}conv1d.", m.conv1d, "weight", (3 * heads * D, 1, k), _segments(0, conv))
        m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = 3 * heads * D
        gate = m.forget_gate
        self.column(f"{prefix}forget_gate.f_b_proj.", gate.f_b_proj, rows)
        self.param(f"{prefix}forget_gate.", gate, "dt_bias", (heads * D,), _segments(0, rows))
        self.param(f"{prefix}forget_gate.", gate, "A_log", (1, 1, heads, 1), _segments(2, [(start, heads)]))
        gate.num_heads = heads
        self.column(f"{prefix}b_proj.", m.b_proj, [(start, heads)])
        self.column(f"{prefix}g_b_proj.", m.g_b_proj, rows)
        self.row(f"{prefix}o_proj.", m.o_proj, rows[0])
        m.num_heads, m.qkv_dim, m.conv_dim = heads, heads * D, 3 * heads * D
        shapes = {"conv": (3 * heads * D, k - 1), "recurrent": (heads, D, D)}
        m.spec = dataclasses.replace(m.spec, state=tuple(dataclasses.replace(s, shape=shapes[s.name])
                                                          for s in m.spec.state))
        self.reduce_output(m)

    def latent_attention(self, prefix: str, m: nn.Module) -> None:
        """MLA: query heads split; the latent (one per token, shared by every head) is whole on every rank."""
        heads = _even("num_attention_heads", m.num_heads, self.world)
        start, qk, kv = self.rank * heads, m.nope + m.rope, m.nope + m.v_dim
        q = m.q_b_proj if m.q_lora else m.q_proj
        self.column(f"{prefix}{'q_b_proj' if m.q_lora else 'q_proj'}.", q, [(start * qk, heads * qk)])
        self.column(f"{prefix}kv_b_proj.", m.kv_b_proj, [(start * kv, heads * kv)])
        self.row(f"{prefix}o_proj.", m.o_proj, (start * m.v_dim, heads * m.v_dim))
        m.num_heads = heads
        self.reduce_output(m)

    def mlstm(self, prefix: str, m: nn.Module) -> None:
        """xLSTM's mLSTM cell: heads split (q, k, v, the output gate, the input and forget gates, the
        per-head norm)."""
        heads = _even("num_heads", m.num_heads, self.world)
        h0, H, dk, dv, qk, v = self.rank * heads, m.num_heads, m.dk, m.dv, m.qk_dim, m.v_dim
        q_seg, v_seg, g_seg = (h0 * dk, heads * dk), (h0 * dv, heads * dv), (h0, heads)
        if m.weight_mode == "single":
            for name, seg in (("q", q_seg), ("k", q_seg), ("v", v_seg), ("ogate_preact", v_seg),
                              ("igate_preact", g_seg), ("fgate_preact", g_seg)):
                self.column(f"{prefix}{name}.", getattr(m, name), [seg])
        else:
            self.column(f"{prefix}qkv_opreact.", m.qkv_opreact, [q_seg, (qk + q_seg[0], q_seg[1]),
                                                                 (2 * qk + v_seg[0], v_seg[1]),
                                                                 (2 * qk + v + v_seg[0], v_seg[1])])
            self.column(f"{prefix}ifgate_preact.", m.ifgate_preact, [g_seg, (H + h0, heads)])
        norm = m.multihead_norm
        self.param(f"{prefix}multihead_norm.", norm, "weight", (heads * dv,), _segments(0, [v_seg]))
        if norm.bias is not None:
            self.param(f"{prefix}multihead_norm.", norm, "bias", (heads * dv,), _segments(0, [v_seg]))
        norm.num_heads = heads
        self.row(f"{prefix}out_proj.", m.out_proj, v_seg)
        m.num_heads, m.qk_dim, m.v_dim = heads, heads * dk, heads * dv
        shapes = {"C": (heads, dk, dv), "n": (heads, dk), "m": (heads,)}
        m.spec = dataclasses.replace(m.spec, state=tuple(dataclasses.replace(s, shape=shapes[s.name])
                                                          for s in m.spec.state))
        self.reduce_output(m)

    def xlstm_feed_forward(self, prefix: str, m: nn.Module) -> None:
        up = _even("the feed-forward width", m.up_dim, self.world) * self.world
        start, size = self.share(up)
        if m.fused:
            self.column(f"{prefix}proj_up_gate_z.", m.proj_up_gate_z, [(start, size), (up + start, size)])
        else:
            self.column(f"{prefix}proj_up_gate.", m.proj_up_gate, [(start, size)])
            self.column(f"{prefix}proj_up.", m.proj_up, [(start, size)])
        self.row(f"{prefix}proj_down.", m.proj_down, (start, size))
        m.up_dim = size
        self.reduce_output(m)

    def short_conv(self, prefix: str, m: nn.Module) -> None:
        """LFM2's gated short conv: channels split; ``in_proj`` yields ``[b | c | h]``, each ``hidden`` wide."""
        hidden = m.out_proj.in_features
        _even("hidden_size (short conv channels)", hidden, self.world)
        start, size = self.share(hidden)
        self.column(f"{prefix}in_proj.", m.in_proj, [(i * hidden + start, size) for i in range(3)])
        k = m.conv.weight.shape[-1]
        self.param(f"{prefix}conv.", m.conv, "weight", (size, 1, k), _segments(0, [(start, size)]))
        if m.conv.bias is not None:
            self.param(f"{prefix}conv.", m.conv, "bias", (size,), _segments(0, [(start, size)]))
        m.conv.in_channels = m.conv.out_channels = m.conv.groups = size
        self.row(f"{prefix}out_proj.", m.out_proj, (start, size))
        m.spec = dataclasses.replace(m.spec, state=tuple(dataclasses.replace(s, shape=(size, k - 1))
                                                          for s in m.spec.state))
        self.reduce_output(m)

    def split_mlp(self, prefix: str, m: nn.Module, gate: str, up: str, down: str) -> None:
        """A gated MLP under other names (LFM2's ``w1``, ``w3``, ``w2``)."""
        inter = getattr(m, down).in_features
        _even("intermediate_size", inter, self.world)
        share = self.share(inter)
        self.column(f"{prefix}{gate}.", getattr(m, gate), [share])
        self.column(f"{prefix}{up}.", getattr(m, up), [share])
        self.row(f"{prefix}{down}.", getattr(m, down), share)
        self.reduce_output(m)

    def gated_delta_net(self, prefix: str, m: GatedDeltaNet) -> None:
        """Key heads split over the ranks, each with the value heads that read it (grouped projections)."""
        w, r = self.world, self.rank
        Hk, Hv, Dk, Dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        hk = _even("linear_num_key_heads", Hk, w)
        hv, R = Hv // w, Hv // Hk
        block = 2 * Dk + 2 * R * Dv  # in_proj_qkvz rows per key head
        self.column(f"{prefix}in_proj_qkvz.", m.in_proj_qkvz, [(r * hk * block, hk * block)])
        self.column(f"{prefix}in_proj_ba.", m.in_proj_ba, [(r * hk * 2 * R, hk * 2 * R)])
        conv = [(r * hk * Dk, hk * Dk), (Hk * Dk + r * hk * Dk, hk * Dk), (2 * Hk * Dk + r * hv * Dv, hv * Dv)]
        conv_dim = 2 * hk * Dk + hv * Dv
        k = m.conv1d.weight.shape[-1]
        self.param(f"{prefix}conv1d.", m.conv1d, "weight", (conv_dim, 1, k), _segments(0, conv))
        if m.conv1d.bias is not None:
            self.param(f"{prefix}conv1d.", m.conv1d, "bias", (conv_dim,), _segments(0, conv))
        m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = conv_dim
        for name in ("dt_bias", "A_log"):
            self.param(prefix, m, name, (hv,), _segments(0, [(r * hv, hv)]))
        self.row(f"{prefix}out_proj.", m.out_proj, (r * hv * Dv, hv * Dv))
        m.num_k_heads, m.num_v_heads = hk, hv
        m.key_dim, m.value_dim, m.conv_dim = hk * Dk, hv * Dv, conv_dim
        shapes = {"conv": (conv_dim, k - 1), "recurrent": (hv, Dk, Dv)}
        m.spec = dataclasses.replace(m.spec, state=tuple(dataclasses.replace(s, shape=shapes[s.name])
                                                          for s in m.spec.state))
        self.reduce_output(m)

    def embedding(self, prefix: str, m: Embedding) -> None:
        vocab = m.num_embeddings
        local = -(-vocab // self.world)
        start = self.rank * local
        real = max(0, min(vocab, start + local) - start)
        self.param(prefix, m, "weight", (local, m.embedding_dim), _segments(0, [(start, real)], pad_to=local))
        m.__class__ = VocabParallelEmbedding
        m.num_embeddings, m.vocab_start, m.group = local, start, self.group

    def lm_head(self, prefix: str, m: nn.Linear, vocab: int) -> None:
        local = -(-vocab // self.world)
        start = self.rank * local
        real = max(0, min(vocab, start + local) - start)
        self.param(prefix, m, "weight", (local, m.in_features), _segments(0, [(start, real)], pad_to=local))
        if m.bias is not None:
            self.param(prefix, m, "bias", (local,), _segments(0, [(start, real)], pad_to=local))
        m.out_features = local


_SPANNING: dict[type, type] = {}


def spanning_class(norm_class: type) -> type:
    """``norm_class`` (an RMSNorm or a subclass: its rounding) made a :class:`SpanningRMSNorm`; one class each."""
    if norm_class not in _SPANNING:
        _SPANNING[norm_class] = type(f"Spanning{norm_class.__name__}", (SpanningRMSNorm, norm_class), {})
    return _SPANNING[norm_class]


def _drop_shared(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """FusedExperts on ranks other than 0: no shared-expert output to add (rank 0 adds it once)."""
    if len(args) > 3:
        args = args[:3]
    kwargs.pop("shared", None)
    return args, kwargs


def shard_model(model: nn.Module, architecture: str, group: TPGroup) -> None:
    """Shard ``model`` (built on the meta device) for ``group``'s rank; sets ``model.tp_slicers`` and
    ``model.tp_vocab_size``. A config whose counts cannot be split raises ValueError naming them."""
    check_supported(architecture, group.world)
    sharder = Sharder(group)
    vocab = model.hf_config.vocab_size
    handlers: list[tuple[type, Callable[[str, Any], None]]] = [
        (Attention, sharder.attention), (Mamba2Mixer, sharder.mamba2), (GatedMLP, sharder.gated_mlp),
        (PlainMLP, sharder.plain_mlp), (FusedExperts, sharder.experts), (Embedding, sharder.embedding),
        (GatedDeltaNet, sharder.gated_delta_net), (Mamba1Mixer, sharder.mamba1)]
    named: dict[str, Callable[[str, Any], None]] = {  # a family's own layers, by class name
        "GraniteMoeHybridMLP": lambda p, m: sharder.fused_gate_up_mlp(p, m, "input_linear", "output_linear"),
        "FalconH1MLP": sharder.gated_mlp, "FalconH1Attention": sharder.attention,
        "Zamba2Attention": sharder.attention, "Zamba2MLP": sharder.zamba2_mlp,
        "OlmoHybridAttention": sharder.whole_projection_norm_attention, "KimiDeltaAttention": sharder.kda,
        "LatentAttention": sharder.latent_attention, "Lfm2ShortConv": sharder.short_conv,
        "LightningAttention": sharder.lightning_attention, "MLSTMLayer": sharder.mlstm,
        "XLSTMFeedForward": sharder.xlstm_feed_forward,
        "Lfm2MLP": lambda p, m: sharder.split_mlp(p, m, "w1", "w3", "w2")}
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        by_name = named.get(type(module).__name__)
        if by_name is not None:
            by_name(prefix, module)
            continue
        for cls, handler in handlers:
            if type(module) is cls:
                handler(prefix, module)
                break
            if isinstance(module, cls):  # a subclass may compute over more than one rank's slice
                raise ValueError(f"tensor parallel is not supported for {architecture} yet: its "
                                 f"{type(module).__name__} ({name}) is not sharded")
    sharder.lm_head("lm_head.", model.lm_head, vocab)
    model.tp_slicers = sharder.slicers
    model.tp_vocab_size = vocab
    model.tp_group = group


def gather_logits(model: nn.Module, method: str, hidden: torch.Tensor) -> torch.Tensor:
    """``model.<method>(hidden)`` (compute_logits or sampling_logits) over the whole vocabulary: each rank's
    slice (N, V / ranks), gathered (N, V)."""
    local = getattr(model, method)(hidden)  # (N, V_local)
    full = model.tp_group.all_gather_last(local)  # (N, ranks * V_local)
    vocab = model.tp_vocab_size
    return full if full.shape[-1] == vocab else full[:, :vocab].contiguous()


@dataclasses.dataclass
class RankGeometry:
    """Rank and world size alone: enough to shard a meta model for a check (nothing runs on it)."""

    rank: int
    world: int


def check_shardable(hf_config: Any, cache_dtypes: Any, world: int) -> None:
    """Shard a meta copy of the model for rank 0 of ``world``: ValueError (naming the counts, or the
    architecture) when it cannot run tensor-parallel. Cheap: no weights are read."""
    from hybridserve.models import fp8_checkpoint
    from hybridserve.models.loader import architecture_of
    from hybridserve.models.registry import model_class

    architecture = architecture_of(hf_config)
    check_supported(architecture, world)
    if fp8_checkpoint.fp8_config(hf_config) is not None:
        raise ValueError(f"tensor parallel does not shard fp8 checkpoints yet (tensor_parallel_size={world})")
    with torch.device("meta"):
        model = model_class(architecture)(hf_config, cache_dtypes)
    shard_model(model, architecture, RankGeometry(0, world))
