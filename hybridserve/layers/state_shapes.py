"""Each mixer's cache spec from its sizes alone: one torch-free function per mixer.

The layers call these to declare their specs, and ``hybridserve plan`` reaches the same calls through the model
built on the meta device, so a state's shape is written down once. Nothing here imports torch.
Shapes are per sequence for states, per token for attention KV.
"""

from __future__ import annotations

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec


def attention_spec(index: int, dtypes: CacheDtypes, num_kv_heads: int, head_dim: int,
                   sliding_window: int | None = None) -> LayerCacheSpec:
    """Softmax attention: K and V ``(num_kv_heads, head_dim)`` per token (a window bounds a sliding one)."""
    return LayerCacheSpec(index, "sliding_attention" if sliding_window else "attention",
                          attention=dtypes.attention(int(num_kv_heads), int(head_dim), sliding_window))


def mla_spec(index: int, dtypes: CacheDtypes, kv_lora_rank: int, rope_dim: int) -> LayerCacheSpec:
    """Multi-head latent attention: one latent of ``kv_lora_rank + rope_dim`` values per token."""
    return LayerCacheSpec(index, "mla", attention=dtypes.latent_attention(int(kv_lora_rank), int(rope_dim)))


def mamba1_spec(index: int, dtypes: CacheDtypes, *, intermediate: int, d_state: int,
                conv_kernel: int) -> LayerCacheSpec:
    """Mamba1: conv ``(intermediate, kernel - 1)``, ssm ``(intermediate, d_state)``."""
    return LayerCacheSpec(index, "mamba", state=(
        dtypes.conv_state("conv", (int(intermediate), int(conv_kernel) - 1)),
        dtypes.temporal_state("ssm", (int(intermediate), int(d_state)))))


def mamba2_conv_dim(intermediate: int, n_groups: int, d_state: int) -> int:
    """Mamba2's convolved channels: x, then B and C of every group."""
    return int(intermediate) + 2 * int(n_groups) * int(d_state)


def mamba2_spec(index: int, dtypes: CacheDtypes, *, intermediate: int, n_groups: int, d_state: int,
                conv_kernel: int, num_heads: int, head_dim: int) -> LayerCacheSpec:
    """Mamba2: conv ``(intermediate + 2 * groups * d_state, kernel - 1)``, ssm ``(heads, head_dim, d_state)``."""
    return LayerCacheSpec(index, "mamba2", state=(
        dtypes.conv_state("conv", (mamba2_conv_dim(intermediate, n_groups, d_state), int(conv_kernel) - 1)),
        dtypes.temporal_state("ssm", (int(num_heads), int(head_dim), int(d_state)))))


def short_conv_spec(index: int, dtypes: CacheDtypes, *, hidden: int, conv_kernel: int) -> LayerCacheSpec:
    """LFM2's short convolution: conv ``(hidden, kernel - 1)``."""
    return LayerCacheSpec(index, "short_conv", state=(dtypes.conv_state("conv", (int(hidden), int(conv_kernel) - 1)),))


def gated_delta_net_conv_dim(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """The gated delta net's convolved channels: q and k of every key head, v of every value head."""
    return 2 * int(num_k_heads) * int(head_k_dim) + int(num_v_heads) * int(head_v_dim)


def gated_delta_net_spec(index: int, dtypes: CacheDtypes, *, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                         head_v_dim: int, conv_kernel: int) -> LayerCacheSpec:
    """Gated delta net: conv ``(2 * key heads * key dim + value heads * value dim, kernel - 1)``, recurrent
    ``(value heads, key dim, value dim)``."""
    conv_dim = gated_delta_net_conv_dim(num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    return LayerCacheSpec(index, "gated_delta_net", state=(
        dtypes.conv_state("conv", (conv_dim, int(conv_kernel) - 1)),
        dtypes.temporal_state("recurrent", (int(num_v_heads), int(head_k_dim), int(head_v_dim)), "gated_delta_net")))


def kda_spec(index: int, dtypes: CacheDtypes, *, num_heads: int, head_dim: int, conv_kernel: int) -> LayerCacheSpec:
    """Kimi delta attention: conv ``(3 * heads * head_dim, kernel - 1)`` (q, k, v), recurrent
    ``(heads, head_dim, head_dim)``."""
    return LayerCacheSpec(index, "kda", state=(
        dtypes.conv_state("conv", (3 * int(num_heads) * int(head_dim), int(conv_kernel) - 1)),
        dtypes.temporal_state("recurrent", (int(num_heads), int(head_dim), int(head_dim)), "kda")))


def linear_attention_spec(index: int, dtypes: CacheDtypes, *, num_heads: int, head_dim: int) -> LayerCacheSpec:
    """Lightning (linear) attention: kv_state ``(heads, head_dim, head_dim)``."""
    return LayerCacheSpec(index, "linear_attention", state=(
        dtypes.temporal_state("kv_state", (int(num_heads), int(head_dim), int(head_dim))),))


def mlstm_spec(index: int, dtypes: CacheDtypes, *, num_heads: int, qk_head_dim: int,
               v_head_dim: int) -> LayerCacheSpec:
    """mLSTM: C ``(heads, qk head, v head)``, n ``(heads, qk head)``, m ``(heads,)``."""
    heads, dk, dv = int(num_heads), int(qk_head_dim), int(v_head_dim)
    return LayerCacheSpec(index, "mlstm", state=(dtypes.temporal_state("C", (heads, dk, dv), "mlstm"),
                                                 dtypes.temporal_state("n", (heads, dk), "mlstm"),
                                                 dtypes.stabilizer_state("m", (heads,))))
