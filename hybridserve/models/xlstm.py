"""xLSTM (NX-AI's xLSTM-7b and its config class): a stack of mLSTM blocks, no attention, so no KV pages.

Block (HF's ``xLSTMBlock``): ``x = x + mlstm_layer(norm_mlstm(x))``, ``x = x + ffn(norm_ffn(x))``; then
``out_norm`` (HF applies it whatever ``add_out_norm`` says, with no bias) and the LM head, whose float32
logits are soft-capped at ``output_logit_soft_cap``. Each residual add is left pending and fused into
the next norm (``RMSNorm.add_and_norm``, the same rounding).

The config's kernel choices (``chunkwise_kernel``, ``sequence_kernel``, ``step_kernel``), ``mode``,
``chunk_size``, ``max_inference_chunksize`` and ``autocast_kernel_dtype`` pick how HF computes the same
recurrence; here prefill runs the chunkwise form (``ops/mlstm.py``) and decode the step, or the CPU
kernel for both. The state dtype is ``mamba_ssm_cache_dtype``'s (HF's ``inference_state_dtype`` and
its cache in the model dtype are not used). Norm reductions always run in float32
(``norm_reduction_force_float32`` False changes nothing for a float32 model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.mlp import ActAndMul
from hybridserve.layers.mlstm import MLSTMLayer
from hybridserve.layers.norms import RMSNorm
from hybridserve.models.base import CausalLM
from hybridserve.ops.mlstm import soft_cap


def round_up(x: float, multiple: int) -> int:
    """HF's ``round_up_to_next_multiple_of``."""
    return int(((x + multiple - 1) // multiple) * multiple)


class BiasedRMSNorm(RMSNorm):
    """HF's ``xLSTMRMSNorm`` with ``use_bias``: the RMS norm, then ``+ bias`` in the activation dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    # the norm kernels take no bias: this norm stays on the PyTorch path (its decode is not captured)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_torch(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, scale: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + residual * scale if scale != 1.0 else x + residual
        return x, self._forward_torch(x)

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        return super()._forward_torch(x) + self.bias


def make_norm(config: Any, bias: bool) -> RMSNorm:
    return BiasedRMSNorm(config.hidden_size, config.norm_eps) if bias else RMSNorm(config.hidden_size, config.norm_eps)


class XLSTMFeedForward(nn.Module):
    """HF's ``xLSTMFeedForward``: ``proj_down(silu(proj_up_gate(x)) * proj_up(x))`` (``weight_mode`` fused:
    one ``proj_up_gate_z`` giving [gate | up])."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.use_bias
        self.up_dim = round_up(hidden * config.ffn_proj_factor, config.ffn_round_up_to_multiple_of)
        self.fused = config.weight_mode == "fused"
        if self.fused:
            self.proj_up_gate_z = nn.Linear(hidden, 2 * self.up_dim, bias=bias)
        else:
            self.proj_up_gate = nn.Linear(hidden, self.up_dim, bias=bias)
            self.proj_up = nn.Linear(hidden, self.up_dim, bias=bias)
        self.proj_down = nn.Linear(self.up_dim, hidden, bias=bias)
        self.act_and_mul = ActAndMul("silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        if self.fused:
            gate, up = torch.split(self.proj_up_gate_z(x), [self.up_dim, self.up_dim], dim=-1)
        else:
            gate, up = self.proj_up_gate(x), self.proj_up(x)
        return self.proj_down(self.act_and_mul(gate, up))


class XLSTMBlock(nn.Module):
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.norm_mlstm = make_norm(config, config.use_bias)
        self.mlstm_layer = MLSTMLayer(config, index, dtypes)
        self.norm_ffn = make_norm(config, config.use_bias)
        self.ffn = XLSTMFeedForward(config)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) residual stream; pending: the previous block's feed-forward output, not yet
        added (or None). Returns (x, this block's feed-forward output)."""
        x, h = (x, self.norm_mlstm(x)) if pending is None else self.norm_mlstm.add_and_norm(x, pending)
        x, h = self.norm_ffn.add_and_norm(x, self.mlstm_layer(h, batch))
        return x, self.ffn(h)


class XLSTMBackbone(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.embeddings = Embedding(config.vocab_size, config.embedding_dim)
        self.blocks = nn.ModuleList(XLSTMBlock(config, i, dtypes) for i in range(config.num_blocks))
        self.out_norm = RMSNorm(config.hidden_size, config.norm_eps)


class xLSTMForCausalLM(CausalLM):  # noqa: N801 (HF's architecture name)
    tied_weights: dict[str, str] = {}  # HF's xLSTM never ties its LM head (no tied keys), whatever the config says

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.backbone = XLSTMBackbone(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logit_soft_cap = config.output_logit_soft_cap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.backbone.embeddings(input_ids)  # (T, hidden)
        pending = None
        for block in self.backbone.blocks:
            x, pending = block(x, pending, batch)
        return self.backbone.out_norm.add_and_norm(x, pending)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> soft-capped float32 logits (N, vocab), as HF caps them."""
        return soft_cap(self.lm_head(hidden).float(), self.logit_soft_cap)
