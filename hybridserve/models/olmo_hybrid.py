"""OLMo-Hybrid: gated delta net layers and attention layers, each with a SwiGLU MLP.

What is another family's computation, and where it differs:

* gated delta net: Qwen3-Next's conv, l2-normalized recurrence and norm-then-gate output norm
  (``layers/gated_deltanet.py``), with ``beta = 2 sigmoid(b)`` when ``linear_allow_neg_eigval`` (the
  layer's ``beta_scale``) and the output norm's eps fixed at 1e-5, as HF's. The checkpoint stores the
  projections apart (``q_proj``, ``k_proj``, ``v_proj``, the gate ``g_proj``, ``b_proj``, ``a_proj``) and
  names the output ``o_norm`` / ``o_proj``: ``transform_checkpoint`` reorders them into Qwen3-Next's
  grouped ``in_proj_qkvz`` / ``in_proj_ba`` (``grouped_projections``) and ``norm`` / ``out_proj``, so the
  layer and its CPU kernels are Qwen3-Next's. The conv weight is stored in three parts (``q_conv1d``,
  ``k_conv1d``, ``v_conv1d``, rows concatenated in that order, as HF loads them) or whole. With more
  value heads than key heads, value head h reads key head h // (Hv / Hk), as HF's ``repeat_interleave``
  of q and k and as Qwen3-Next's grouping (the value heads one key head serves are consecutive in
  ``v_proj``, ``g_proj``, ``b_proj`` and ``a_proj``).
* checkpoint norm names: OLMo-core's ``attention_layer_norm`` / ``feedforward_layer_norm`` load as
  ``input_layernorm`` / ``post_attention_layernorm`` (HF's renaming), HF's own names as they are.
* attention (OLMo-3's): ``q_norm`` / ``k_norm`` are RMS norms over the whole q / k projection (all heads
  at once), before RoPE; RoPE only when ``rope_parameters`` names a ``rope_theta`` (the released
  checkpoints have none: NoPE).
* layer pattern: a gated-delta-net layer is pre-norm (``input_layernorm``, ``post_attention_layernorm``,
  Llama's); an attention layer is post-norm (``x + post_attention_layernorm(attn(x))``, then
  ``x + post_feedforward_layernorm(mlp(x))``, OLMo-2's). Every RMS norm multiplies its weight into the
  float32 normalized value and rounds once after (Nemotron-H's rounding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.forward_batch import ForwardBatch
from hybridserve.layers.attention import Attention
from hybridserve.layers.embedding import Embedding
from hybridserve.layers.gated_deltanet import GatedDeltaNet, grouped_projections
from hybridserve.layers.mlp import GatedMLP
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.base import RopeDecoderLM
from hybridserve.models.nemotron_h import NemotronHRMSNorm
from hybridserve.ops.attend import paged_attend
from hybridserve.ops.elementwise import add, rotate

#: HF's output-norm eps of the gated delta net (FLA's default), whatever ``rms_norm_eps`` says
GDN_NORM_EPS = 1e-5
LAYER_KINDS = ("linear_attention", "full_attention")


class OlmoHybridRMSNorm(NemotronHRMSNorm):
    """HF's ``OlmoHybridRMSNorm``: ``(weight * rms_norm(x).float()).to(dtype)``, Nemotron-H's rounding."""


def head_dim_of(config: Any) -> int:
    """The attention head size: ``head_dim`` when the config has one, else hidden / heads (HF's rule)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def uses_rope(config: Any) -> bool:
    """Whether attention rotates q and k: ``rope_parameters`` present with a ``rope_theta`` (HF's rule)."""
    params = getattr(config, "rope_parameters", None)
    return params is not None and params.get("rope_theta") is not None


class NoRotary(nn.Module):
    """Stands in for ``rotary_emb`` without RoPE (NoPE): no (cos, sin) for any position."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        return None


class OlmoHybridAttention(Attention):
    """OLMo-3's attention: q/k RMS norms over the whole projection (all heads), then RoPE (if any)."""

    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        head_dim = head_dim_of(config)
        super().__init__(index, config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         dtypes, bias=config.attention_bias)
        self.q_norm = OlmoHybridRMSNorm(config.num_attention_heads * head_dim, config.rms_norm_eps)
        self.k_norm = OlmoHybridRMSNorm(config.num_key_value_heads * head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                batch: ForwardBatch) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(t, self.num_heads, self.head_dim)  # (T, Hq, Dh)
        k = self.k_norm(self.k_proj(x)).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, Dh)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        out = paged_attend(q, k, v, batch, batch.caches[self.layer_index], self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class OlmoHybridLinearAttentionDecoderLayer(nn.Module):
    """Pre-norm: ``x + linear_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    kind = "linear_attention"

    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.linear_attn = GatedDeltaNet(
            index, config.hidden_size, num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads, head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim, dtypes=dtypes,
            norm_eps=GDN_NORM_EPS, activation=config.hidden_act,
            beta_scale=2.0 if config.linear_allow_neg_eigval else 1.0)
        self.input_layernorm = OlmoHybridRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OlmoHybridRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending: the previous layer's last output, not yet added (or None). Returns
        (x, this layer's MLP output), each residual add fused into the next norm."""
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add_and_norm(x, pending)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.linear_attn(h, batch))
        return x, self.mlp(h)


class OlmoHybridAttentionDecoderLayer(nn.Module):
    """Post-norm: ``x + post_attention_layernorm(self_attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``."""

    kind = "full_attention"
    def __init__(self, config: Any, index: int, dtypes: CacheDtypes) -> None:
        super().__init__()
        self.self_attn = OlmoHybridAttention(config, index, dtypes)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_attention_layernorm = OlmoHybridRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = OlmoHybridRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden); pending as for the linear-attention layer. Returns (x, the normed MLP output,
        left for the next layer's add)."""
        if pending is not None:
            x = add(x, pending)
        h = self.post_attention_layernorm(self.self_attn(x, rope, batch))
        x = add(x, h)
        return x, self.post_feedforward_layernorm(self.mlp(x))


class OlmoHybridModel(nn.Module):
    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__()
        bad = [(i, kind) for i, kind in enumerate(config.layer_types[:config.num_hidden_layers])
               if kind not in LAYER_KINDS]
        if bad:
            raise ValueError(f"layer_types: layer {bad[0][0]} has type {bad[0][1]!r}, not supported by OLMo-Hybrid; "
                             f"supported: {', '.join(LAYER_KINDS)}")
        layer_class = {"linear_attention": OlmoHybridLinearAttentionDecoderLayer,
                       "full_attention": OlmoHybridAttentionDecoderLayer}
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class[config.layer_types[i]](config, i, dtypes)
                                    for i in range(config.num_hidden_layers))
        self.norm = OlmoHybridRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config)) if uses_rope(config) else NoRotary()


class OlmoHybridForCausalLM(RopeDecoderLM):
    fused_residual = True
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    #: the checkpoint's norm names (OLMo-core's) as HF's modules name them, as HF renames them on load
    checkpoint_renames = [(r"\.attention_layer_norm\.", ".input_layernorm."),
                          (r"\.feedforward_layer_norm\.", ".post_attention_layernorm.")]

    def __init__(self, config: Any, dtypes: CacheDtypes) -> None:
        super().__init__(config)
        self.model = OlmoHybridModel(config, dtypes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def transform_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each gated delta net's separate projections as Qwen3-Next's grouped ``in_proj_qkvz`` /
        ``in_proj_ba``, its conv weight's parts joined, ``o_norm`` / ``o_proj`` as ``norm`` / ``out_proj``;
        a ValueError names a layer's missing or mis-shaped weights."""
        tensors = dict(tensors)
        for i, layer in enumerate(self.model.layers):
            if layer.kind != "linear_attention":
                continue
            gdn, prefix = layer.linear_attn, f"model.layers.{i}.linear_attn."
            hidden = gdn.in_proj_qkvz.in_features
            hk, hv = gdn.checkpoint_heads  # the checkpoint's (whole) head counts, tensor-parallel or not
            key_dim, value_dim = hk * gdn.head_k_dim, hv * gdn.head_v_dim
            rows = {"q_proj": key_dim, "k_proj": key_dim, "v_proj": value_dim, "g_proj": value_dim,
                    "b_proj": hv, "a_proj": hv}
            names = {p: f"{prefix}{p}.weight" for p in rows}
            missing = [n for n in names.values() if n not in tensors]
            if missing:
                raise ValueError(f"checkpoint lacks the gated delta net projections {missing}")
            for p, n in rows.items():
                if tuple(tensors[names[p]].shape) != (n, hidden):
                    raise ValueError(f"{names[p]} has shape {tuple(tensors[names[p]].shape)}, expected {(n, hidden)}")
            w = {p: tensors.pop(n) for p, n in names.items()}
            qkv = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])  # (2 Hk Dk + Hv Dv, hidden)
            qkvz, ba = grouped_projections(qkv, w["g_proj"], w["b_proj"], w["a_proj"], num_k_heads=hk,
                                           num_v_heads=hv, head_k_dim=gdn.head_k_dim, head_v_dim=gdn.head_v_dim)
            tensors[f"{prefix}in_proj_qkvz.weight"], tensors[f"{prefix}in_proj_ba.weight"] = qkvz, ba
            parts = [f"{prefix}{p}_conv1d.weight" for p in "qkv"]
            if any(n in tensors for n in parts):
                missing = [n for n in parts if n not in tensors]
                if missing:
                    raise ValueError(f"checkpoint lacks the gated delta net conv weights {missing}")
                conv = torch.cat([tensors.pop(n) for n in parts])  # (2 Hk Dk + Hv Dv, 1, K)
                if conv.shape[0] != 2 * key_dim + value_dim:
                    raise ValueError(f"{prefix}{{q,k,v}}_conv1d.weight have {conv.shape[0]} rows together, "
                                     f"expected {2 * key_dim + value_dim}")
                tensors[f"{prefix}conv1d.weight"] = conv
            for old, new in (("o_norm", "norm"), ("o_proj", "out_proj")):
                if f"{prefix}{old}.weight" in tensors:  # absent: reported missing as the model's name
                    tensors[f"{prefix}{new}.weight"] = tensors.pop(f"{prefix}{old}.weight")
        return tensors


__all__ = ["OlmoHybridForCausalLM"]
