"""A test fixture: write a tiny safetensors checkpoint (tests/checkpoints.py) as a GGUF file the way llama.cpp's
converter does (its tensor names from gguf.TensorNameMap, its metadata keys and its tensor transforms), with the
linear weights in a chosen GGUF type (blocks encoded here for Q4_K and Q6_K, which the gguf package cannot make)."""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
ARCHS = {"llama": "LLAMA", "mamba": "MAMBA", "mamba2": "MAMBA2", "granitemoehybrid": "GRANITE_HYBRID",
         "nemotron_h": "NEMOTRON_H", "falcon_h1": "FALCON_H1", "lfm2": "LFM2", "jamba": "JAMBA",
         "qwen3_next": "QWEN3NEXT", "qwen3_5_text": "QWEN35", "qwen3_5_moe_text": "QWEN35MOE", "lfm2_moe": "LFM2MOE",
         "bamba": "GRANITE_HYBRID"}
GGUF_ARCH = {"llama": "llama", "mamba": "mamba", "mamba2": "mamba2", "granitemoehybrid": "granitehybrid",
             "nemotron_h": "nemotron_h", "falcon_h1": "falcon-h1", "lfm2": "lfm2", "jamba": "jamba",
             "qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe",
             "lfm2_moe": "lfm2moe", "bamba": "granitehybrid"}
QWEN3_5 = ("qwen3_5_text", "qwen3_5_moe_text")
# Falcon-H1: the muP multiplier llama.cpp's converter folds into each tensor, by a part of its name (first match)
FALCON_FOLDS = (("down_proj", lambda c: c["mlp_multipliers"][1]), ("gate_proj", lambda c: c["mlp_multipliers"][0]),
                ("k_proj", lambda c: c["key_multiplier"] * c["attention_in_multiplier"]),
                ("q_proj", lambda c: c["attention_in_multiplier"]), ("v_proj", lambda c: c["attention_in_multiplier"]),
                ("o_proj", lambda c: c["attention_out_multiplier"]), ("out_proj", lambda c: c["ssm_out_multiplier"]),
                ("in_proj", lambda c: c["ssm_in_multiplier"]), ("lm_head", lambda c: c["lm_head_multiplier"]),
                ("embed_tokens", lambda c: c["embedding_multiplier"]))


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """(N, K) float32 -> Q6_K blocks (N, K / 256 * 210) uint8."""
    N, K = w.shape
    b = w.reshape(-1, 16, 16)  # (blocks, 16 groups, 16)
    group_scale = np.abs(b).max(-1) / 31.0  # (n, 16)
    d = (group_scale.max(-1) / 127.0).astype(np.float16).astype(np.float32)  # (n,)
    d_safe = np.where(d == 0, 1.0, d)
    sc = np.clip(np.round(group_scale / d_safe[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.where(step[..., None] == 0, 0, np.round(b / np.where(step == 0, 1, step)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # (n, half, 128)
    ql = (q[:, :, :64] & 0xF) | ((q[:, :, 64:] & 0xF) << 4)  # (n, 2, 64)
    hi = q >> 4
    qh = hi[:, :, :32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:] << 6)  # (n, 2, 32)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1)
    return blocks.reshape(N, -1)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """(N, K) float32 -> Q4_K blocks (N, K / 256 * 144) uint8."""
    N, K = w.shape
    b = w.reshape(-1, 8, 32)
    low = np.minimum(b.min(-1), 0.0)  # (n, 8): the sub-block's min, at most 0
    step_f = (b.max(-1) - low) / 15.0
    d = (step_f.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step_f / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    step, offset = d[:, None] * sc, -(dmin[:, None] * m)
    q = np.round((b - offset[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(np.where(step[..., None] == 0, 0, q), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    blocks = np.concatenate([_f16(d), _f16(dmin), packed, qs], axis=1)
    return blocks.reshape(N, -1)


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """A 2-D float32 weight in GGUF type ``kind`` (raw uint8 rows, or float32/float16 for those types)."""
    if kind == "Q6_K":
        return encode_q6_k(w)
    if kind == "Q4_K":
        return encode_q4_k(w)
    return gguf.quants.quantize(w, T[kind])


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for its rope (its llama converter's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w: gguf.GGUFWriter, family: str, cfg: dict, state: dict, blocks: int) -> None:
    w.add_block_count(blocks)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", cfg.get("norm_eps", 1e-5))))
    for key in ("bos", "eos", "pad"):
        if cfg.get(f"{key}_token_id") is not None:
            getattr(w, f"add_{key}_token_id")(cfg[f"{key}_token_id"])
    if family == "llama":
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_context_length(cfg["max_position_embeddings"])
    if family in ("mamba", "mamba2"):
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_state_size(cfg["state_size"])
        w.add_ssm_inner_size(cfg["expand"] * cfg["hidden_size"])
        w.add_ssm_time_step_rank(cfg["time_step_rank"] if family == "mamba" else cfg["num_heads"])
        if family == "mamba2":
            w.add_ssm_group_count(cfg["n_groups"])
    if family == "nemotron_h":
        kinds = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
        pattern = cfg.get("hybrid_override_pattern") or "".join(kinds[t] for t in cfg["layers_block_type"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if c == "*" else 0 for c in pattern])
        moe = "num_experts_per_tok" in cfg  # what llama.cpp's converter takes for its nemotron_h_moe architecture
        w.add_feed_forward_length([(cfg["moe_intermediate_size"] if c == "E" else 0) if moe else
                                   (cfg["intermediate_size"] if c == "-" else 0) for c in pattern])
        if moe:
            w.add_expert_count(cfg["n_routed_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            w.add_expert_group_count(cfg["n_group"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        _ssm_metadata(w, cfg["mamba_num_heads"] * cfg["mamba_head_dim"], cfg["mamba_num_heads"], cfg["ssm_state_size"],
                      cfg["n_groups"], cfg["conv_kernel"])
    if family == "falcon_h1":
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_context_length(cfg["max_position_embeddings"])
        _ssm_metadata(w, cfg["mamba_d_ssm"], cfg["mamba_n_heads"], cfg["mamba_d_state"], cfg["mamba_n_groups"],
                      cfg["mamba_d_conv"])
    if family == "lfm2":
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]])
        w.add_feed_forward_length(state["model.layers.0.feed_forward.w1.weight"].shape[0])
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_context_length(cfg["max_position_embeddings"])
    if family == "lfm2_moe":
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_leading_dense_block_count(cfg["num_dense_layers"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_context_length(cfg["max_position_embeddings"])
    if family == "bamba":
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if i in cfg["attn_layer_indices"] else 0
                             for i in range(cfg["num_hidden_layers"])])
        w.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"]))
        w.add_rope_scaling_finetuned(True)
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_context_length(cfg["max_position_embeddings"])
        _ssm_metadata(w, cfg["mamba_expand"] * cfg["hidden_size"], cfg["mamba_n_heads"], cfg["mamba_d_state"],
                      cfg["mamba_n_groups"], cfg["mamba_d_conv"])
    if family == "jamba":
        layers = cfg["num_hidden_layers"]
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if i % cfg["attn_layer_period"] == cfg["attn_layer_offset"]
                             else 0 for i in range(layers)])
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_inner_size(cfg["mamba_expand"] * cfg["hidden_size"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_time_step_rank(cfg["mamba_dt_rank"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_context_length(cfg["max_position_embeddings"])
    if family in QWEN3_5:
        rope = cfg["rope_parameters"]
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_dimension_count(int(cfg["head_dim"] * rope["partial_rotary_factor"]))
        w.add_rope_dimension_sections([*rope["mrope_section"], 0])
        if family == "qwen3_5_text":
            w.add_feed_forward_length(cfg["intermediate_size"])
        else:
            _qwen_experts_metadata(w, cfg)
        _qwen_delta_net_metadata(w, cfg)
    if family == "qwen3_next":
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
        _qwen_experts_metadata(w, cfg)
        _qwen_delta_net_metadata(w, cfg)
    if family == "granitemoehybrid":
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if t in ("attention", "full_attention") else 0
                             for t in cfg["layer_types"]])
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_group_count(cfg["mamba_n_groups"])
        w.add_ssm_inner_size(cfg["mamba_expand"] * cfg["hidden_size"])
        w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
        w.add_rope_scaling_finetuned(cfg.get("position_embedding_type") == "rope")
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
        if cfg.get("num_local_experts"):
            w.add_expert_count(cfg["num_local_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["intermediate_size"])


def _qwen_experts_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """The expert counts and sizes of a Qwen3-Next / Qwen3.5-MoE config."""
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _qwen_delta_net_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """The gated delta net's sizes and the context length of a Qwen3-Next / Qwen3.5 config."""
    _ssm_metadata(w, cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"], cfg["linear_num_value_heads"],
                  cfg["linear_key_head_dim"], cfg["linear_num_key_heads"], cfg["linear_conv_kernel_dim"])
    w.add_context_length(cfg["max_position_embeddings"])


def _ssm_metadata(w: gguf.GGUFWriter, inner: int, heads: int, state: int, groups: int, conv: int) -> None:
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_conv_kernel(conv)


def _converted(family: str, cfg: dict, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) -> llama.cpp's (GGUF-side HF-like name, tensor) after its transforms."""
    if family == "falcon_h1":
        t = _falcon_fold(cfg, name, t)
    if family == "qwen3_next":
        return _qwen3_next(cfg, name, t)
    if family in QWEN3_5:
        return _qwen3_next(cfg, name, _tile_value_heads(cfg, name, t))
    if family == "lfm2_moe" and name.endswith("feed_forward.expert_bias"):
        return [(name.replace("feed_forward.expert_bias", "@exp_probs_b") + ".bias", t)]
    if name.endswith("A_log"):
        t = -torch.exp(t.float())
        if family not in ("mamba", "jamba"):
            t = t.reshape(-1, 1)
    if family not in ("mamba", "jamba") and name.endswith(".D"):
        t = t.reshape(-1, 1)
    if "conv1d.weight" in name or "conv.conv.weight" in name:
        t = t.squeeze()
    grouped_norm = ("mamba2", "granitemoehybrid", "nemotron_h", "falcon_h1", "bamba")
    if family in grouped_norm and re.search(
            r"mixer\.norm\.weight$|mamba\.norm\.weight$", name):
        t = t.reshape(cfg.get("n_groups", cfg.get("mamba_n_groups")), -1)
    rope_permuted = ("llama", "granitemoehybrid", "nemotron_h", "bamba")
    if family in rope_permuted and re.search(r"\.(q_proj|k_proj)\.weight$", name):
        heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
        t = _permute(t, heads)
    shexp = "_shexp" if cfg.get("num_local_experts") else ""  # Granite's shared MLP beside experts, or alone
    if family == "granitemoehybrid" and name.endswith("shared_mlp.input_linear.weight"):
        gate, up = t.split(cfg["shared_intermediate_size"], dim=0)
        return [(name.replace("shared_mlp.input_linear", f"@ffn_gate{shexp}"), gate),
                (name.replace("shared_mlp.input_linear", f"@ffn_up{shexp}"), up)]
    if family == "granitemoehybrid" and name.endswith("shared_mlp.output_linear.weight"):
        return [(name.replace("shared_mlp.output_linear", f"@ffn_down{shexp}"), t)]
    if family == "granitemoehybrid" and name.endswith("block_sparse_moe.input_linear.weight"):
        gate, up = t.split(cfg["intermediate_size"], dim=1)
        return [(name.replace("block_sparse_moe.input_linear", "@ffn_gate_exps"), gate),
                (name.replace("block_sparse_moe.input_linear", "@ffn_up_exps"), up)]
    if family == "granitemoehybrid" and name.endswith("block_sparse_moe.output_linear.weight"):
        return [(name.replace("block_sparse_moe.output_linear", "@ffn_down_exps"), t)]
    if family == "nemotron_h" and name.endswith("gate.e_score_correction_bias"):
        return [(name.replace("mixer.gate.e_score_correction_bias", "@exp_probs_b").replace(".weight", "") + ".bias",
                 t)]
    return [(name, t)]


def _qwen3_next(cfg: dict, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """llama.cpp's Qwen3-Next transforms: A = -exp(A_log), conv1d squeezed, RMS norms as 1 + w (not the gated
    delta net's), in_proj_qkvz split into attn_qkv (all q, all k, all v) and attn_gate (z)."""
    if name.endswith("A_log"):
        t = -torch.exp(t.float())
    if "conv1d" in name:
        t = t.squeeze()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t.float() + 1
    if name.endswith("in_proj_qkvz.weight"):
        nk, hk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
        vz = cfg["linear_num_value_heads"] // nk * cfg["linear_value_head_dim"]
        q, k, v, z = t.reshape(nk, 2 * hk + 2 * vz, -1).split([hk, hk, vz, vz], dim=1)
        qkv = torch.cat([q.reshape(nk * hk, -1), k.reshape(nk * hk, -1), v.reshape(nk * vz, -1)])
        return [(name.replace("linear_attn.in_proj_qkvz", "@attn_qkv"), qkv),
                (name.replace("linear_attn.in_proj_qkvz", "@attn_gate"), z.reshape(nk * vz, -1))]
    return [(name, t)]


def _tile_value_heads(cfg: dict, name: str, t: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Qwen3.5 transform: the gated delta net's value heads, grouped by key head in the checkpoint,
    tiled over the key heads (v0 of every key head, then v1, ...) in every tensor that has them."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hv, qk = cfg["linear_value_head_dim"], 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]

    def tile(x: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], nk, nv // nk, head, *shape[dim + 1:]).transpose(dim, dim + 1)
        return x.reshape(shape)

    if ".linear_attn." not in name or nk == nv:
        return t
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([t[:qk], tile(t[qk:], 0, hv)])
    if name.endswith("in_proj_z.weight"):
        return tile(t, 0, hv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return tile(t, 0, 1)
    if name.endswith("out_proj.weight"):
        return tile(t, 1, hv)
    return t


def _falcon_fold(cfg: dict, name: str, t: torch.Tensor) -> torch.Tensor:
    """Falcon-H1's multipliers folded into the tensor, as llama.cpp's converter does."""
    t = t.float()
    for part, multiplier in FALCON_FOLDS:
        if part in name:
            t = t * multiplier(cfg)
            break
    if "in_proj" in name:  # the five parts of zxbcdt each have their own multiplier
        inner, gs = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        bounds = [0, inner, 2 * inner, 2 * inner + gs, 2 * inner + 2 * gs, t.shape[0]]
        scale = torch.ones(t.shape[0])
        for i, m in enumerate(cfg["ssm_multipliers"]):
            scale[bounds[i]:bounds[i + 1]] = m
        t = t * scale.reshape(-1, *([1] * (t.dim() - 1)))
    return t


def _gguf_name(table: gguf.TensorNameMap, name: str) -> str:
    if "@" in name:  # a name written directly: model.layers.N.@ffn_gate.weight
        block = re.search(r"layers\.(\d+)\.@([\w.]+)\.(\w+)$", name)
        assert block is not None, name
        return f"blk.{block.group(1)}.{block.group(2)}.{block.group(3)}"
    hf = name.replace(".dt_bias", ".dt_proj.bias")
    out = table.get_name(hf, try_suffixes=(".weight", ".bias"))
    if out is None:
        raise KeyError(f"no GGUF name for {name}")
    return out


def _stack_experts(state: dict) -> dict:
    """Per-expert ``...experts.{e}.up_proj.weight`` stacked into ``...@ffn_up_exps.weight`` (E, I, H), as llama.cpp's
    converter stacks Nemotron-H's experts."""
    out, stacks = {}, {}
    for name, t in state.items():
        m = re.match(r"^(.*)\.(?:mixer|feed_forward|mlp)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$", name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
    for (prefix, proj), parts in stacks.items():
        part = {"w1": "gate", "w2": "down", "w3": "up"}.get(proj, proj.removesuffix("_proj"))
        out[f"{prefix}.@ffn_{part}_exps.weight"] = torch.stack([parts[e] for e in sorted(parts)])
    return out


#: the converter's names for Qwen's MTP head tensors (``mtp.fc`` -> ``blk.N.nextn.eh_proj``, ...)
MTP_HEAD = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
            "norm": "shared_head_norm"}


def _mtp_as_layers(state: dict, layers: int) -> dict:
    """Qwen's ``mtp.*`` tensors as llama.cpp's converter writes them: ``mtp.layers.i.X`` as layer ``layers + i``, the
    head's ``mtp.fc`` and norms as that layer's nextn tensors."""
    out = {}
    for name, t in state.items():
        parts = name.split(".", 3)
        if parts[0] != "mtp":
            out[name] = t
        elif parts[1] == "layers":
            out[f"model.layers.{layers + int(parts[2])}.{parts[3]}"] = t
        else:
            out[f"model.layers.{layers}.@nextn.{MTP_HEAD[parts[1]]}.{parts[2]}"] = t
    return out


def write_gguf(checkpoint: str, out: str, kind: str = "F32", quantize_embeddings: bool = False) -> str:
    """Write ``checkpoint`` (a folder from tests/checkpoints.py) as GGUF file ``out``: float tensors in F32 (or
    BF16/F16 when ``kind`` is one of them), the linear weights (2-D, K a whole number of blocks) in ``kind``."""
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    family = cfg["model_type"]
    layers = cfg.get("num_hidden_layers") or len(cfg["layers_block_type"])
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    mtp = int(cfg.get("mtp_num_hidden_layers", 0) or 0) if family == "qwen3_next" or family in QWEN3_5 else 0
    state = _stack_experts(_mtp_as_layers(state, layers))
    layers += mtp
    table = gguf.TensorNameMap(getattr(gguf.MODEL_ARCH, ARCHS[family]), layers)
    tensors = [(n2, t2) for n, t in state.items() for n2, t2 in _converted(family, cfg, n, t)]
    arch = "nemotron_h_moe" if family == "nemotron_h" and "num_experts_per_tok" in cfg else GGUF_ARCH[family]
    if arch != GGUF_ARCH[family]:
        table = gguf.TensorNameMap(gguf.MODEL_ARCH.NEMOTRON_H_MOE, layers)
    w = gguf.GGUFWriter(out, arch)
    _metadata(w, family, cfg, state, layers)  # the converter counts the MTP layers in block_count
    if mtp:
        w.add_nextn_predict_layers(mtp)
    for name, t in tensors:
        gname = _gguf_name(table, name)
        x = t.float().numpy()
        is_linear = x.ndim in (2, 3) and gname.endswith(".weight") and "norm" not in gname and (
            quantize_embeddings or "token_embd" not in gname)
        quantized = kind not in ("F32", "F16", "BF16")
        is_linear = is_linear and "ffn_gate_inp" not in gname  # llama-quantize keeps routers in float
        if quantized and is_linear and x.shape[-1] % gguf.GGML_QUANT_SIZES[T[kind]][0] == 0:
            raw = encode(x.reshape(-1, x.shape[-1]), kind)
            w.add_tensor(gname, raw.reshape(*x.shape[:-1], raw.shape[-1]), raw_dtype=T[kind])
        elif kind == "BF16" or (quantized and t.dtype == torch.bfloat16):
            w.add_tensor(gname, gguf.quants.quantize(x, T.BF16), raw_dtype=T.BF16)
        elif kind == "F16":
            w.add_tensor(gname, x.astype(np.float16))
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out



