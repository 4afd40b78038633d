"""Qwen3-Next: gated delta net layers and gated attention layers, each followed by a sparse MoE
block (routed experts plus a sigmoid-gated shared expert) or a dense MLP; zero-centered RMS norms."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.kernels import gemm
from hybridserve.kernels import pointwise as pointwise_kernels
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.gated_deltanet import GatedDeltaNet
from hybridserve.layers.mlp import GatedMLP
from hybridserve.layers.moe import FusedExperts, softmax_topk, stack_expert_weights
from hybridserve.layers.norms import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import RopeDecoderLM
from hybridserve.ops.dispatch import call


class Qwen3NextSparseMoeBlock(nn.Module):
    """Softmax top-k router (``gate``), fused experts, and ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.gate.quantize = False  # a router: its logits pick experts (kept out of int8 weights)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                    config.hidden_act)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        logits = self.gate(x)  # (T, E)
        return call("qwen3_next_moe", lambda: self._forward_kernels(x, logits), lambda: self._forward_plain(x, logits),
                    logits, x)

    def _forward_kernels(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """Routing and the shared expert's gate on kernels: routed + shared, each rounded (None: declined)."""
        routed = gemm.router_topk(logits, self.top_k, "softmax_then_topk", self.norm_topk_prob)
        shared = pointwise_kernels.row_sigmoid_gate(self.shared_expert_gate(x), self.shared_expert(x))
        if routed is None or shared is None:
            return None
        return self.experts(x, *routed, shared)

    def _forward_plain(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The PyTorch body."""
        index, weight = softmax_topk(logits, self.top_k, self.norm_topk_prob)  # (T, k)
        routed = self.experts(x, index, weight)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


def _uses_moe(config: Any, index: int) -> bool:
    """HF's rule: MoE unless listed in ``mlp_only_layers``, if experts exist and the layer falls on
    ``decoder_sparse_step``."""
    return (index not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes, layer_type: str | None = None,
                 cache_index: int | None = None) -> None:
        """``layer_type`` and ``cache_index`` override ``config.layer_types[index]`` and the cache index
        (default ``index``): a multi-token-prediction layer (``models/mtp_qwen3_next.py``) is a full-attention
        layer whose MoE rule reads its place among the MTP layers and whose cache sits after the model's."""
        super().__init__()
        self.kind = layer_type or config.layer_types[index]
        cache_index = index if cache_index is None else cache_index
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cache_index, config.hidden_size, num_k_heads=config.linear_num_key_heads,
                num_v_heads=config.linear_num_value_heads, head_k_dim=config.linear_key_head_dim,
                head_v_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim,
                dtypes=dtypes, norm_eps=config.rms_norm_eps, activation=config.hidden_act)
        elif self.kind == "full_attention":
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.self_attn = Attention(cache_index, config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, head_dim, dtypes,
                                       bias=getattr(config, "attention_bias", False),
                                       qk_norm_eps=config.rms_norm_eps, qk_norm_zero_centered=True,
                                       output_gate=True)
        else:
            raise ValueError(f"layer {index}: layer type {self.kind!r} is not supported by Qwen3-Next; "
                             "supported: linear_attention, full_attention")
        if _uses_moe(config, index):
            self.mlp = Qwen3NextSparseMoeBlock(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous MLP's output, not yet added (or None). Returns (x, this
        layer's MLP output), each residual add fused into the next norm."""
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add_and_norm(x, pending)
        h = self.linear_attn(h, batch) if self.kind == "linear_attention" else self.self_attn(h, rope, batch)
        x, h = self.post_attention_layernorm.add_and_norm(x, h)
        return x, self.mlp(h)


class Qwen3NextModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i, dtypes) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim)  # partial rotary from rope_parameters


class Qwen3NextLMBase(RopeDecoderLM):
    fused_residual = True
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = Qwen3NextModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def transform_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert weights; drop the multi-token-prediction head (``mtp.*``), which HF also
        ignores on load."""
        return stack_expert_weights({n: t for n, t in tensors.items() if not n.startswith("mtp.")},
                                    r".*\.mlp\.experts")


class Qwen3NextForCausalLM(Qwen3NextLMBase):
    """Qwen3-Next (HF weight names)."""
