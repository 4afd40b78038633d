"""Sharding the recurrent layers: Mamba2, Mamba1, gated delta net, KDA, short conv and mLSTM. Each rank keeps
its heads (groups, channels) and the state slice they own."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.distributed.layers import RowParallelLinear, SpanningNormMamba2Mixer
from hybridserve.distributed.sharder import Sharder, even, slicer
from hybridserve.layers.gated_deltanet import GatedDeltaNet
from hybridserve.layers.mamba1 import Mamba1Mixer
from hybridserve.layers.mamba2 import Mamba2Mixer


def mamba2(sh: Sharder, prefix: str, m: Mamba2Mixer) -> None:
    w, r = sh.world, sh.rank
    H, G, N, inter = m.num_heads, m.n_groups, m.d_state, m.intermediate
    heads = even("mamba num_heads", H, w)
    inter_l = even("mamba intermediate_size", inter, w)
    if G % w == 0:
        groups, g_start = G // w, r * (G // w)
    elif w % G == 0:  # fewer groups than ranks: each rank keeps (a copy of) the group its heads read
        groups, g_start = 1, r // (w // G)
        if m.norm is not None and m.norm.group_size > inter_l:  # the norm's group spans w / G ranks
            if m.norm.group_size != inter // G:
                raise ValueError(f"mamba norm groups of {m.norm.group_size} channels (n_groups={G}) cannot be "
                                 f"split over tensor_parallel_size={w}")
            m.__class__ = SpanningNormMamba2Mixer
            m.group, m.norm_group, m.norm_groups, m.norm_group_size = sh.group, g_start, G, m.norm.group_size
    else:
        raise ValueError(f"mamba n_groups={G} neither divides nor is divisible by tensor_parallel_size={w}")
    x_seg = (r * inter_l, inter_l)
    b_seg, c_seg = (g_start * N, groups * N), (G * N + g_start * N, groups * N)
    proj = [x_seg, (inter + x_seg[0], inter_l), (2 * inter + b_seg[0], b_seg[1]), (2 * inter + c_seg[0], c_seg[1]),
            (2 * inter + 2 * G * N + r * heads, heads)]
    sh.column(f"{prefix}in_proj.", m.in_proj, proj)
    conv = [x_seg, (inter + b_seg[0], b_seg[1]), (inter + c_seg[0], c_seg[1])]
    conv_dim = inter_l + 2 * groups * N
    k = m.conv1d.weight.shape[-1]
    sh.param(f"{prefix}conv1d.", m.conv1d, "weight", (conv_dim, 1, k), slicer(0, conv))
    if m.conv1d.bias is not None:
        sh.param(f"{prefix}conv1d.", m.conv1d, "bias", (conv_dim,), slicer(0, conv))
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = conv_dim
    for name in ("dt_bias", "A_log", "D"):
        sh.param(prefix, m, name, (heads,), slicer(0, [(r * heads, heads)]))
    if m.norm is not None:
        sh.param(f"{prefix}norm.", m.norm, "weight", (inter_l,), slicer(0, [x_seg]))
    sh.row(f"{prefix}out_proj.", m.out_proj, x_seg)
    m.num_heads, m.n_groups, m.intermediate, m.conv_dim = heads, groups, inter_l, conv_dim
    if m.proj_multipliers is not None:
        m.proj_scale = torch.empty(m.in_proj.out_features, device=m.proj_scale.device)
    shapes = {"conv": (conv_dim, k - 1), "ssm": (heads, m.head_dim, N)}
    m.spec = sh.state_slices(m.spec, shapes)
    sh.reduce_output(m)


def mamba1(sh: Sharder, prefix: str, m: Mamba1Mixer) -> None:
    """Channels split over the ranks; ``x_proj`` (dt, B, C from every channel) sums its partial outputs."""
    inter = m.intermediate
    even("mamba intermediate_size", inter, sh.world)
    start, size = sh.share(inter)
    sh.column(f"{prefix}in_proj.", m.in_proj, [(start, size), (inter + start, size)])
    k = m.conv1d.weight.shape[-1]
    sh.param(f"{prefix}conv1d.", m.conv1d, "weight", (size, 1, k), slicer(0, [(start, size)]))
    if m.conv1d.bias is not None:
        sh.param(f"{prefix}conv1d.", m.conv1d, "bias", (size,), slicer(0, [(start, size)]))
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = size
    sh.param(f"{prefix}x_proj.", m.x_proj, "weight", (m.x_proj.out_features, size), slicer(1, [(start, size)]))
    m.x_proj.in_features = size
    m.x_proj.__class__ = RowParallelLinear
    m.x_proj.group = sh.group
    sh.column(f"{prefix}dt_proj.", m.dt_proj, [(start, size)])
    sh.param(prefix, m, "A_log", (size, m.d_state), slicer(0, [(start, size)]))
    sh.param(prefix, m, "D", (size,), slicer(0, [(start, size)]))
    sh.row(f"{prefix}out_proj.", m.out_proj, (start, size))
    m.intermediate = size
    shapes = {"conv": (size, k - 1), "ssm": (size, m.d_state)}
    m.spec = sh.state_slices(m.spec, shapes)
    sh.reduce_output(m)


def gated_delta_net(sh: Sharder, prefix: str, m: GatedDeltaNet) -> None:
    """Key heads split over the ranks, each with the value heads that read it (grouped projections)."""
    w, r = sh.world, sh.rank
    Hk, Hv, Dk, Dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    hk = even("linear_num_key_heads", Hk, w)
    hv, R = Hv // w, Hv // Hk
    block = 2 * Dk + 2 * R * Dv  # in_proj_qkvz rows per key head
    sh.column(f"{prefix}in_proj_qkvz.", m.in_proj_qkvz, [(r * hk * block, hk * block)])
    sh.column(f"{prefix}in_proj_ba.", m.in_proj_ba, [(r * hk * 2 * R, hk * 2 * R)])
    conv = [(r * hk * Dk, hk * Dk), (Hk * Dk + r * hk * Dk, hk * Dk), (2 * Hk * Dk + r * hv * Dv, hv * Dv)]
    conv_dim = 2 * hk * Dk + hv * Dv
    k = m.conv1d.weight.shape[-1]
    sh.param(f"{prefix}conv1d.", m.conv1d, "weight", (conv_dim, 1, k), slicer(0, conv))
    if m.conv1d.bias is not None:
        sh.param(f"{prefix}conv1d.", m.conv1d, "bias", (conv_dim,), slicer(0, conv))
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = conv_dim
    for name in ("dt_bias", "A_log"):
        sh.param(prefix, m, name, (hv,), slicer(0, [(r * hv, hv)]))
    sh.row(f"{prefix}out_proj.", m.out_proj, (r * hv * Dv, hv * Dv))
    m.num_k_heads, m.num_v_heads = hk, hv
    m.key_dim, m.value_dim, m.conv_dim = hk * Dk, hv * Dv, conv_dim
    shapes = {"conv": (conv_dim, k - 1), "recurrent": (hv, Dk, Dv)}
    m.spec = sh.state_slices(m.spec, shapes)
    sh.reduce_output(m)


def kda(sh: Sharder, prefix: str, m: nn.Module) -> None:
    """Kimi delta attention: heads split (q, k, v, the conv over ``[q | k | v]``, the forget gate's
    per-channel output, beta, the output gate); the low-rank inputs of the gates stay whole."""
    heads = even("linear_num_heads", m.num_heads, sh.world)
    start, D, qkv = sh.rank * heads, m.head_dim, m.qkv_dim
    rows = [(start * D, heads * D)]
    for name in ("q_proj", "k_proj", "v_proj"):
        sh.column(f"{prefix}{name}.", getattr(m, name), rows)
    conv = [(i * qkv + start * D, heads * D) for i in range(3)]
    k = m.conv1d.weight.shape[-1]
    sh.param(f"{prefix}conv1d.", m.conv1d, "weight", (3 * heads * D, 1, k), slicer(0, conv))
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = 3 * heads * D
    gate = m.forget_gate
    sh.column(f"{prefix}forget_gate.f_b_proj.", gate.f_b_proj, rows)
    sh.param(f"{prefix}forget_gate.", gate, "dt_bias", (heads * D,), slicer(0, rows))
    sh.param(f"{prefix}forget_gate.", gate, "A_log", (1, 1, heads, 1), slicer(2, [(start, heads)]))
    gate.num_heads = heads
    sh.column(f"{prefix}b_proj.", m.b_proj, [(start, heads)])
    sh.column(f"{prefix}g_b_proj.", m.g_b_proj, rows)
    sh.row(f"{prefix}o_proj.", m.o_proj, rows[0])
    m.num_heads, m.qkv_dim, m.conv_dim = heads, heads * D, 3 * heads * D
    shapes = {"conv": (3 * heads * D, k - 1), "recurrent": (heads, D, D)}
    m.spec = sh.state_slices(m.spec, shapes)
    sh.reduce_output(m)


def short_conv(sh: Sharder, prefix: str, m: nn.Module) -> None:
    """LFM2's gated short conv: channels split; ``in_proj`` yields ``[b | c | h]``, each ``hidden`` wide."""
    hidden = m.out_proj.in_features
    even("hidden_size (short conv channels)", hidden, sh.world)
    start, size = sh.share(hidden)
    sh.column(f"{prefix}in_proj.", m.in_proj, [(i * hidden + start, size) for i in range(3)])
    k = m.conv.weight.shape[-1]
    sh.param(f"{prefix}conv.", m.conv, "weight", (size, 1, k), slicer(0, [(start, size)]))
    if m.conv.bias is not None:
        sh.param(f"{prefix}conv.", m.conv, "bias", (size,), slicer(0, [(start, size)]))
    m.conv.in_channels = m.conv.out_channels = m.conv.groups = size
    sh.row(f"{prefix}out_proj.", m.out_proj, (start, size))
    m.spec = sh.state_slices(m.spec, {"conv": (size, k - 1)})
    sh.reduce_output(m)


def mlstm(sh: Sharder, prefix: str, m: nn.Module) -> None:
    """xLSTM's mLSTM cell: heads split (q, k, v, the output gate, the input and forget gates, the
    per-head norm)."""
    heads = even("num_heads", m.num_heads, sh.world)
    h0, H, dk, dv, qk, v = sh.rank * heads, m.num_heads, m.dk, m.dv, m.qk_dim, m.v_dim
    q_seg, v_seg, g_seg = (h0 * dk, heads * dk), (h0 * dv, heads * dv), (h0, heads)
    if m.weight_mode == "single":
        for name, seg in (("q", q_seg), ("k", q_seg), ("v", v_seg), ("ogate_preact", v_seg),
                          ("igate_preact", g_seg), ("fgate_preact", g_seg)):
            sh.column(f"{prefix}{name}.", getattr(m, name), [seg])
    else:
        sh.column(f"{prefix}qkv_opreact.", m.qkv_opreact, [q_seg, (qk + q_seg[0], q_seg[1]),
                                                             (2 * qk + v_seg[0], v_seg[1]),
                                                             (2 * qk + v + v_seg[0], v_seg[1])])
        sh.column(f"{prefix}ifgate_preact.", m.ifgate_preact, [g_seg, (H + h0, heads)])
    norm = m.multihead_norm
    sh.param(f"{prefix}multihead_norm.", norm, "weight", (heads * dv,), slicer(0, [v_seg]))
    if norm.bias is not None:
        sh.param(f"{prefix}multihead_norm.", norm, "bias", (heads * dv,), slicer(0, [v_seg]))
    norm.num_heads = heads
    sh.row(f"{prefix}out_proj.", m.out_proj, v_seg)
    m.num_heads, m.qk_dim, m.v_dim = heads, heads * dk, heads * dv
    shapes = {"C": (heads, dk, dv), "n": (heads, dk), "m": (heads,)}
    m.spec = sh.state_slices(m.spec, shapes)
    sh.reduce_output(m)
