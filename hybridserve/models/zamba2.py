"""Zamba2 (Zyphra): Mamba2 layers, with a shared attention+MLP block run before some of them.

Layer kinds (``config.layers_block_type``): ``linear_attention`` (a Mamba2 layer) and ``hybrid``
(the shared transformer block, a per-layer ``linear`` projection, then a Mamba2 layer). The shared
block sees ``concat(hidden, original embeddings)`` (width 2 * hidden); it has no residual of its
own: its output, through ``linear``, is added to the Mamba2 layer's input.

There are ``num_mem_blocks`` distinct shared blocks; hybrid layer number ``i`` (counting hybrid
layers only) runs block ``i % num_mem_blocks``. Like HF, every hybrid layer owns a
``shared_transformer`` module (so parameter names match), and when the config ties weights
(``tie_word_embeddings``, as HF requires for any tying) each later use's parameters are tied to
the first use's: a saved checkpoint holds only the first use of each block. Every *use* keeps its
own per-use LoRA-style adapters (``*_adapter_list[i]``) and, above all, its own KV cache: the
attention spec of hybrid layer ``L`` has cache index ``L``, merged with that layer's Mamba2 state
into one ``attention+mamba2`` spec.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes, LayerCacheSpec
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mamba2 import Mamba2Mixer
from hybridserve.layers.mlp import ActAndMul
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import CausalLM
from hybridserve.ops.attend import paged_attend
from hybridserve.ops.elementwise import add, concat_cols, rotate

HYBRID = "hybrid"
MAMBA_KINDS = ("linear_attention", "mamba", "mamba2")


def _adapter_list(uses: int, block_id: int, num_blocks: int, d_in: int, rank: int, d_out: int) -> nn.ModuleList:
    """One low-rank adapter per use of block ``block_id`` (hybrid index i with i % num_blocks == block_id);
    the other positions are ``nn.Identity`` placeholders (no weights), as in HF."""
    return nn.ModuleList(
        nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))
        if i % num_blocks == block_id else nn.Identity()
        for i in range(uses))


class Zamba2Attention(nn.Module):
    """Attention over ``concat(hidden, embeddings)`` (2 * hidden wide), scale ``(head_dim / 2) ** -0.5``,
    optional per-use q/k/v adapters and RoPE. Its KV cache is the one of hybrid layer ``cache_index``."""

    def __init__(self, config: Any, cache_index: int, use: int, block_id: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.cache_index, self.use = cache_index, use
        d_in = config.attention_hidden_size  # 2 * hidden
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        self.scale = (self.head_dim / 2) ** -0.5
        self.q_proj = nn.Linear(d_in, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_adapter = config.use_shared_attention_adapter
        if self.use_adapter:
            uses, blocks, rank = len(config.hybrid_layer_ids), config.num_mem_blocks, config.adapter_rank
            self.linear_q_adapter_list = _adapter_list(uses, block_id, blocks, d_in, rank, d_in)
            self.linear_k_adapter_list = _adapter_list(uses, block_id, blocks, d_in, rank, d_in)
            self.linear_v_adapter_list = _adapter_list(uses, block_id, blocks, d_in, rank, d_in)
        self.spec = LayerCacheSpec(cache_index, "attention",
                                   attention=dtypes.attention(self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                batch: ForwardBatch) -> torch.Tensor:
        """x: (T, 2 * hidden) -> (T, hidden)."""
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_adapter:
            q = add(q, self.linear_q_adapter_list[self.use](x))
            k = add(k, self.linear_k_adapter_list[self.use](x))
            v = add(v, self.linear_v_adapter_list[self.use](x))
        q = q.view(t, self.num_heads, self.head_dim)  # (T, Hq, Dh)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, Dh)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        out = paged_attend(q, k, v, batch, batch.caches[self.cache_index], self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))



class Zamba2MLP(nn.Module):
    """``down(act(g) * u)`` with ``[g, u] = gate_up_proj(x) + adapter_use(x)``."""

    def __init__(self, config: Any, use: int, block_id: int) -> None:
        super().__init__()
        self.use = use
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=config.add_bias_linear)
        self.down_proj = nn.Linear(inter, hidden, bias=config.add_bias_linear)
        self.act_and_mul = ActAndMul(config.hidden_act)
        self.gate_up_proj_adapter_list = _adapter_list(len(config.hybrid_layer_ids), block_id,
                                                       config.num_mem_blocks, hidden, config.adapter_rank, 2 * inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = add(self.gate_up_proj(x), self.gate_up_proj_adapter_list[self.use](x))  # (T, 2 * inter)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act_and_mul(gate, up))


class Zamba2AttentionDecoderLayer(nn.Module):
    """The shared block: norm(concat) -> attention -> norm -> MLP (no residuals)."""

    def __init__(self, config: Any, cache_index: int, use: int, block_id: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.self_attn = Zamba2Attention(config, cache_index, use, block_id, dtypes)
        self.feed_forward = Zamba2MLP(config, use, block_id)
        self.input_layernorm = RMSNorm(config.attention_hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, original: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(concat_cols(x, original))  # (T, 2 * hidden)
        h = self.self_attn(h, rope, batch)
        return self.feed_forward(self.pre_ff_layernorm(h))


class Zamba2MambaDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        inter = int(config.mamba_expand * config.hidden_size)
        self.mamba = Mamba2Mixer(
            index, config.hidden_size, num_heads=config.n_mamba_heads, head_dim=config.mamba_headdim,
            d_state=config.mamba_d_state, n_groups=config.mamba_ngroups, conv_kernel=config.mamba_d_conv,
            chunk_size=config.chunk_size, dtypes=dtypes, intermediate_size=inter, conv_bias=True,
            proj_bias=config.add_bias_linear, norm_eps=1e-5,
            # HF clamps dt from below in the chunked scan only; its single-token update does not clamp
            time_step_limit=(config.time_step_min, float("inf")), decode_time_step_limit=(0.0, float("inf")),
            norm_in_float32=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, shared: torch.Tensor | None = None) -> torch.Tensor:
        h = x if shared is None else add(x, shared)
        return add(x, self.mamba(self.input_layernorm(h), batch))


class Zamba2HybridLayer(nn.Module):
    def __init__(self, config: Any, index: int, use: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        block_id = use % config.num_mem_blocks
        self.shared_transformer = Zamba2AttentionDecoderLayer(config, index, use, block_id, dtypes)
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = Zamba2MambaDecoderLayer(config, index, dtypes)

    def forward(self, x: torch.Tensor, original: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        shared = self.linear(self.shared_transformer(x, original, rope, batch))
        return self.mamba_decoder(x, batch, shared)


class Zamba2Model(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = []
        self.first_use: dict[int, int] = {}  # hybrid layer index -> layer index of its block's first use
        block_owner: dict[int, int] = {}  # block id -> layer index of its first use
        for index, kind in enumerate(config.layers_block_type):
            if kind == HYBRID:
                use = len(self.first_use)  # hybrid layers before this one
                block_id = use % config.num_mem_blocks
                self.first_use[index] = block_owner.setdefault(block_id, index)
                layers.append(Zamba2HybridLayer(config, index, use, dtypes))
            elif kind in MAMBA_KINDS:
                layers.append(Zamba2MambaDecoderLayer(config, index, dtypes))
            else:
                raise ValueError(f"Zamba2 layer {index}: unknown layer kind {kind!r}; "
                                 f"known: {HYBRID}, {', '.join(MAMBA_KINDS)}")
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, config.attention_head_dim) if config.use_mem_rope else None


class Zamba2ForCausalLM(CausalLM):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = Zamba2Model(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # With tie_word_embeddings (HF ties nothing otherwise): the LM head is the embedding, and every
        # later use of a shared block takes the parameters of that block's first use.
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
        for index, first in self.model.first_use.items():
            if index != first:
                prefix = f"model.layers.{index}.shared_transformer."
                source = f"model.layers.{first}.shared_transformer."
                for name, _ in self.model.layers[index].shared_transformer.named_parameters():
                    tied[prefix + name] = source + name
        self.tied_weights = tied

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        original = x
        rope = self.model.rotary_emb(positions, x.dtype) if self.model.rotary_emb is not None else None
        for layer in self.model.layers:
            if isinstance(layer, Zamba2HybridLayer):
                x = layer(x, original, rope, batch)
            else:
                x = layer(x, batch)
        return self.model.final_layernorm(x)
