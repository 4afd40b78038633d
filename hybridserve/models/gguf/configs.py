"""A GGUF file's metadata -> the transformers config of its model family, so the rest of the engine (plan, cache
specs, models) runs as it does on a config.json. One builder per llama.cpp architecture (``general.architecture``);
the keys are those llama.cpp's converter writes (``gguf.Keys``)."""

from __future__ import annotations

from typing import Any, Callable

from hybridserve.models.gguf.meta import Meta, rms_eps, ssm_sizes


def _llama(m: Meta) -> Any:
    from transformers import LlamaConfig

    layers = int(m.need("block_count"))
    heads = int(m.need("attention.head_count"))
    hidden = int(m.need("embedding_length"))
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=int(m.need("feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(m.per_layer("attention.head_count_kv", layers)),
        head_dim=int(m.get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(m.get("context_length", 4096)), attention_bias=m.has("blk.0.attn_q.bias"),
        mlp_bias=m.has("blk.0.ffn_up.bias"), **m.rope(), **m.common())


def _mamba(m: Meta) -> Any:
    from transformers import FalconMambaConfig, MambaConfig

    hidden, inner = int(m.need("embedding_length")), int(m.need("ssm.inner_size"))
    cls = FalconMambaConfig if m.get("ssm.dt_b_c_rms") else MambaConfig
    return cls(hidden_size=hidden, state_size=int(m.need("ssm.state_size")),
               num_hidden_layers=int(m.need("block_count")), conv_kernel=int(m.need("ssm.conv_kernel")),
               expand=inner // hidden, time_step_rank=int(m.need("ssm.time_step_rank")),
               layer_norm_epsilon=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
               use_bias=m.has("blk.0.ssm_in.bias"), use_conv_bias=m.has("blk.0.ssm_conv1d.bias"), **m.common())


def _mamba2(m: Meta) -> Any:
    from transformers import Mamba2Config

    hidden, inner, heads = ssm_sizes(m)
    return Mamba2Config(hidden_size=hidden, num_hidden_layers=int(m.need("block_count")), num_heads=heads,
                        head_dim=inner // heads, state_size=int(m.need("ssm.state_size")),
                        n_groups=int(m.get("ssm.group_count", 1)), conv_kernel=int(m.need("ssm.conv_kernel")),
                        expand=inner // hidden, layer_norm_epsilon=rms_eps(m),
                        use_bias=m.has("blk.0.ssm_in.bias"), use_conv_bias=m.has("blk.0.ssm_conv1d.bias"),
                        **m.common())


#: the multipliers llama.cpp's converter writes for a Granite model (and not for a Bamba one)
_GRANITE_SCALES = ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")


def _granite_hybrid(m: Meta) -> Any:
    """Granite-4.0-H, or Bamba: llama.cpp writes both as ``granitehybrid``; a file with none of Granite's
    multipliers is a Bamba checkpoint (whose attention scale is 1/sqrt(head_dim), not a written one)."""
    from transformers import GraniteMoeHybridConfig

    if not any(m.get(key) is not None for key in _GRANITE_SCALES) and not m.get("expert_count"):
        return _bamba(m)
    layers = int(m.need("block_count"))
    hidden, inner, heads = ssm_sizes(m)
    kv = m.per_layer("attention.head_count_kv", layers)
    experts = int(m.get("expert_count", 0) or 0)
    ffn = int(m.get("feed_forward_length", 0) or 0)
    shared = int(m.get("expert_shared_feed_forward_length", 0) or 0) or ffn
    return GraniteMoeHybridConfig(
        hidden_size=hidden, intermediate_size=int(m.get("expert_feed_forward_length", 0) or ffn),
        shared_intermediate_size=shared, num_hidden_layers=layers,
        layer_types=["attention" if k > 0 else "mamba" for k in kv],
        num_attention_heads=int(m.need("attention.head_count")), num_key_value_heads=max(kv),
        num_local_experts=experts, num_experts_per_tok=int(m.get("expert_used_count", 0) or 0) if experts else 0,
        mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_d_state=int(m.need("ssm.state_size")),
        mamba_n_groups=int(m.get("ssm.group_count", 1)), mamba_d_conv=int(m.need("ssm.conv_kernel")),
        mamba_expand=inner // hidden, mamba_conv_bias=m.has(_first_ssm(m, kv, "ssm_conv1d.bias")),
        mamba_proj_bias=m.has(_first_ssm(m, kv, "ssm_in.bias")),
        position_embedding_type="rope" if m.get("rope.scaling.finetuned") else None,
        embedding_multiplier=float(m.get("embedding_scale", 1.0)),
        residual_multiplier=float(m.get("residual_scale", 1.0)),
        attention_multiplier=float(m.get("attention.scale", 1.0)), logits_scaling=float(m.get("logit_scale", 1.0)),
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(m.get("context_length", 4096)), **m.rope(), **m.common())


def _bamba(m: Meta) -> Any:
    """Bamba: Mamba2 layers and RoPE attention layers (where the per-layer KV head count is not 0), a SwiGLU MLP in
    each; the rotary part of a head from ``rope.dimension_count`` (all of it when the file does not say)."""
    from transformers import BambaConfig

    layers = int(m.need("block_count"))
    hidden, inner, heads = ssm_sizes(m)
    kv = m.per_layer("attention.head_count_kv", layers)
    attn_heads = int(m.need("attention.head_count"))
    head_dim = hidden // attn_heads
    rope = m.rope().get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    rope["partial_rotary_factor"] = int(m.get("rope.dimension_count", head_dim)) / head_dim
    return BambaConfig(
        hidden_size=hidden, intermediate_size=int(m.need("feed_forward_length")), num_hidden_layers=layers,
        attn_layer_indices=[i for i, k in enumerate(kv) if k > 0], num_attention_heads=attn_heads,
        num_key_value_heads=max(kv), mamba_n_heads=heads, mamba_d_head=inner // heads,
        mamba_d_state=int(m.need("ssm.state_size")), mamba_n_groups=int(m.get("ssm.group_count", 1)),
        mamba_d_conv=int(m.need("ssm.conv_kernel")), mamba_expand=inner // hidden,
        mamba_conv_bias=m.has(_first_ssm(m, kv, "ssm_conv1d.bias")),
        mamba_proj_bias=m.has(_first_ssm(m, kv, "ssm_in.bias")), rope_parameters=rope, rms_norm_eps=rms_eps(m),
        max_position_embeddings=int(m.get("context_length", 4096)), **m.common())


def _nemotron_pattern(m: Meta, layers: int) -> str:
    """Nemotron-H's layer pattern from each layer's tensors: Mamba2 ``M``, attention ``*``, experts ``E``, MLP ``-``
    (the MoE architecture's metadata does not tell a dense MLP layer from a Mamba2 one)."""
    kinds = (("ssm_in.weight", "M"), ("attn_q.weight", "*"), ("ffn_up_exps.weight", "E"), ("ffn_up.weight", "-"))
    pattern = ""
    for i in range(layers):
        kind = next((k for tensor, k in kinds if m.has(f"blk.{i}.{tensor}")), None)
        if kind is None:
            raise ValueError(f"{m.file}: layer {i} has none of the tensors of a Nemotron-H layer")
        pattern += kind
    return pattern


def _nemotron_h(m: Meta) -> Any:
    """Nemotron-H, with or without experts (llama.cpp's ``nemotron_h`` and ``nemotron_h_moe``)."""
    from transformers import NemotronHConfig

    layers = int(m.need("block_count"))
    hidden, inner, heads = ssm_sizes(m)
    kv = m.per_layer("attention.head_count_kv", layers)
    ffn = m.per_layer("feed_forward_length", layers)
    pattern = _nemotron_pattern(m, layers)
    attn_heads = int(m.need("attention.head_count"))
    experts: dict[str, Any] = {}
    if "E" in pattern:
        groups = int(m.get("expert_group_count", 1) or 1)
        experts = dict(
            n_routed_experts=int(m.need("expert_count")), num_experts_per_tok=int(m.need("expert_used_count")),
            moe_intermediate_size=int(m.need("expert_feed_forward_length")),
            moe_shared_expert_intermediate_size=int(m.get("expert_shared_feed_forward_length", 0) or 0),
            n_shared_experts=int(m.get("expert_shared_count", 1) or 1),
            norm_topk_prob=bool(m.get("expert_weights_norm")),
            routed_scaling_factor=float(m.get("expert_weights_scale", 1.0)), n_group=groups,
            # llama.cpp does not write the groups a token may pick from, nor restrict them: all of them
            topk_group=int(m.get("expert_group_used_count", groups) or groups))
    # a dense MLP layer's size: its feed_forward_length, or (MoE files write 0 there) its up projection's rows
    dense = [f or m.shapes[f"blk.{i}.ffn_up.weight"][0] for i, (c, f) in enumerate(zip(pattern, ffn)) if c == "-"]
    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    return NemotronHConfig(**experts,
        hidden_size=hidden, layers_block_type=[kinds[c] for c in pattern], num_attention_heads=attn_heads,
        num_key_value_heads=max(kv), head_dim=int(m.get("attention.key_length", hidden // attn_heads)),
        intermediate_size=max(dense) if dense else max(ffn), mamba_num_heads=heads, mamba_head_dim=inner // heads,
        ssm_state_size=int(m.need("ssm.state_size")), n_groups=int(m.get("ssm.group_count", 1)),
        conv_kernel=int(m.need("ssm.conv_kernel")), layer_norm_epsilon=rms_eps(m),
        use_conv_bias=m.has(_first_ssm(m, kv, "ssm_conv1d.bias")),
        mamba_proj_bias=m.has(_first_ssm(m, kv, "ssm_in.bias")),
        max_position_embeddings=int(m.get("context_length", 4096)), **m.common())


def _falcon_h1(m: Meta) -> Any:
    """Falcon-H1. llama.cpp's converter folds every muP multiplier into the weights and writes none of them, so the
    config keeps them all at 1."""
    from transformers import FalconH1Config

    hidden, inner, heads = ssm_sizes(m)
    attn_heads = int(m.need("attention.head_count"))
    return FalconH1Config(  # type: ignore[call-arg]  # head_dim is a keyword the class takes through **kwargs
        hidden_size=hidden, intermediate_size=int(m.need("feed_forward_length")),
        num_hidden_layers=int(m.need("block_count")), num_attention_heads=attn_heads,
        num_key_value_heads=max(m.per_layer("attention.head_count_kv", 1)),
        head_dim=int(m.get("attention.key_length", hidden // attn_heads)), mamba_d_ssm=inner, mamba_n_heads=heads,
        mamba_d_head=inner // heads, mamba_n_groups=int(m.get("ssm.group_count", 1)),
        mamba_d_state=int(m.need("ssm.state_size")), mamba_d_conv=int(m.need("ssm.conv_kernel")),
        mamba_conv_bias=m.has("blk.0.ssm_conv1d.bias"), mamba_proj_bias=m.has("blk.0.ssm_in.bias"),
        mamba_rms_norm=m.has("blk.0.ssm_norm.weight"), mamba_norm_before_gate=False,  # llama.cpp: gate, then norm
        projectors_bias=m.has("blk.0.ssm_out.bias"),
        rms_norm_eps=rms_eps(m),
        max_position_embeddings=int(m.get("context_length", 4096)) or 4096,
        lm_head_multiplier=1.0, embedding_multiplier=1.0, mlp_multipliers=[1.0, 1.0], key_multiplier=1.0,
        attention_out_multiplier=1.0, attention_in_multiplier=1.0, ssm_multipliers=[1.0] * 5, ssm_in_multiplier=1.0,
        ssm_out_multiplier=1.0, **m.rope(), **m.common())


def _lfm2(m: Meta) -> Any:
    """LFM2: short-conv layers where the per-layer KV head count is 0; the feed-forward size as written (llama.cpp
    writes it already adjusted, so the config does not adjust it again)."""
    from transformers import Lfm2Config

    layers = int(m.need("block_count"))
    kv = m.per_layer("attention.head_count_kv", layers)
    return Lfm2Config(
        hidden_size=int(m.need("embedding_length")), intermediate_size=int(m.need("feed_forward_length")),
        block_auto_adjust_ff_dim=False, num_hidden_layers=layers,
        layer_types=["full_attention" if k > 0 else "conv" for k in kv],
        num_attention_heads=int(m.need("attention.head_count")), num_key_value_heads=max(kv),
        conv_L_cache=int(m.need("shortconv.l_cache")), norm_eps=rms_eps(m),
        conv_bias=m.has(_first_ssm(m, kv, "shortconv.conv.bias")),
        max_position_embeddings=int(m.get("context_length", 4096)), **m.rope(), **m.common())


def _lfm2_moe(m: Meta) -> Any:
    """LFM2-MoE: LFM2's short-conv and attention layers; the first ``leading_dense_block_count`` layers with a
    dense MLP, the others with sigmoid-routed experts (an expert bias where the file has ``exp_probs_b``)."""
    from transformers import Lfm2MoeConfig

    layers = int(m.need("block_count"))
    kv = m.per_layer("attention.head_count_kv", layers)
    dense = int(m.get("leading_dense_block_count", 0) or 0)
    return Lfm2MoeConfig(
        hidden_size=int(m.need("embedding_length")), intermediate_size=int(m.need("feed_forward_length")),
        moe_intermediate_size=int(m.need("expert_feed_forward_length")), num_hidden_layers=layers,
        layer_types=["full_attention" if k > 0 else "conv" for k in kv], num_dense_layers=dense,
        num_experts=int(m.need("expert_count")), num_experts_per_tok=int(m.need("expert_used_count")),
        use_expert_bias=m.has(f"blk.{dense}.exp_probs_b.bias"),
        num_attention_heads=int(m.need("attention.head_count")), num_key_value_heads=max(kv),
        conv_L_cache=int(m.need("shortconv.l_cache")), norm_eps=rms_eps(m),
        conv_bias=m.has(_first_ssm(m, kv, "shortconv.conv.bias")),
        max_position_embeddings=int(m.get("context_length", 4096)), **m.rope(), **m.common())


def _period(layers: list[int], count: int, what: str, m: Meta) -> tuple[int, int]:
    """(offset, period) of transformers' ``i % period == offset`` rule that selects exactly ``layers``."""
    if not layers:
        return count, count + 1  # no such layer
    offset = layers[0]
    period = layers[1] - layers[0] if len(layers) > 1 else count
    if [i for i in range(count) if i % period == offset] != layers:
        raise ValueError(f"{m.file}: the {what} layers {layers} are not every {period}th from {offset}")
    return offset, period


def _jamba(m: Meta) -> Any:
    """Jamba: attention where the per-layer KV head count is not 0, experts where the layer has ``ffn_*_exps``."""
    from transformers import JambaConfig

    layers = int(m.need("block_count"))
    hidden, inner = int(m.need("embedding_length")), int(m.need("ssm.inner_size"))
    kv = m.per_layer("attention.head_count_kv", layers)
    attn_offset, attn_period = _period([i for i, k in enumerate(kv) if k > 0], layers, "attention", m)
    moe = [i for i in range(layers) if m.has(f"blk.{i}.ffn_gate_exps.weight")]
    expert_offset, expert_period = _period(moe, layers, "expert", m)
    first_ssm = _first_ssm(m, kv, "")
    return JambaConfig(
        hidden_size=hidden, intermediate_size=int(m.need("feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=int(m.need("attention.head_count")), num_key_value_heads=max(kv),
        attn_layer_offset=attn_offset, attn_layer_period=attn_period, expert_layer_offset=expert_offset,
        expert_layer_period=expert_period, num_experts=int(m.get("expert_count", 1) or 1) if moe else 1,
        num_experts_per_tok=int(m.get("expert_used_count", 1) or 1) if moe else 1,
        mamba_d_state=int(m.need("ssm.state_size")), mamba_d_conv=int(m.need("ssm.conv_kernel")),
        mamba_expand=inner // hidden, mamba_dt_rank=int(m.need("ssm.time_step_rank")),
        mamba_conv_bias=m.has(first_ssm + "ssm_conv1d.bias"), mamba_proj_bias=m.has(first_ssm + "ssm_in.bias"),
        rms_norm_eps=rms_eps(m), max_position_embeddings=int(m.get("context_length", 4096)), **m.common())


def _qwen_hybrid_sizes(m: Meta) -> tuple[int, int, int, int, int, int, dict[str, Any]]:
    """What Qwen3-Next and Qwen3.5 files share: layers, hidden size, delta-net inner size and value heads,
    attention heads, head size, and the attention's partial-RoPE parameters."""
    layers = m.main_layers()
    hidden, inner, value_heads = ssm_sizes(m)
    attn_heads = int(m.need("attention.head_count"))
    head_dim = int(m.get("attention.key_length", hidden // attn_heads))
    rope = m.rope().get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    rope["partial_rotary_factor"] = int(m.get("rope.dimension_count", head_dim)) / head_dim
    return layers, hidden, inner, value_heads, attn_heads, head_dim, rope


def _qwen3_next(m: Meta) -> Any:
    """Qwen3-Next: attention layers where the layer has ``attn_q``, gated delta-net layers elsewhere; experts in
    the layers with a router (``ffn_gate_inp``), a dense MLP in the others."""
    from transformers import Qwen3NextConfig

    layers, hidden, inner, value_heads, attn_heads, head_dim, rope = _qwen_hybrid_sizes(m)
    return Qwen3NextConfig(
        hidden_size=hidden, intermediate_size=int(m.get("feed_forward_length", 0) or 0), num_hidden_layers=layers,
        layer_types=["full_attention" if m.has(f"blk.{i}.attn_q.weight") else "linear_attention"
                     for i in range(layers)],
        num_attention_heads=attn_heads, num_key_value_heads=max(m.per_layer("attention.head_count_kv", layers)),
        head_dim=head_dim, rope_parameters=rope, linear_conv_kernel_dim=int(m.need("ssm.conv_kernel")),
        linear_key_head_dim=int(m.need("ssm.state_size")), linear_num_key_heads=int(m.need("ssm.group_count")),
        linear_num_value_heads=value_heads, linear_value_head_dim=inner // value_heads,
        num_experts=int(m.get("expert_count", 0) or 0), num_experts_per_tok=int(m.get("expert_used_count", 0) or 0),
        moe_intermediate_size=int(m.get("expert_feed_forward_length", 0) or 0),
        shared_expert_intermediate_size=int(m.get("expert_shared_feed_forward_length", 0) or 0),
        decoder_sparse_step=1, mlp_only_layers=[i for i in range(layers) if not m.has(f"blk.{i}.ffn_gate_inp.weight")],
        rms_norm_eps=rms_eps(m), max_position_embeddings=int(m.get("context_length", 4096)), **m.common())


def _qwen3_5(m: Meta) -> Any:
    """Qwen3.5, dense (``qwen35``) or with experts on every layer (``qwen35moe``): Qwen3-Next's layers, its
    attention's partial RoPE interleaved over ``rope.dimension_sections`` (M-RoPE; text positions are the same
    in every section)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    layers, hidden, inner, value_heads, attn_heads, head_dim, rope = _qwen_hybrid_sizes(m)
    sections = m.get("rope.dimension_sections")
    if sections is not None:
        rope.update(mrope_section=[int(s) for s in sections][:3], mrope_interleaved=True)
    common: dict[str, Any] = dict(
        hidden_size=hidden, num_hidden_layers=layers,
        layer_types=["full_attention" if m.has(f"blk.{i}.attn_q.weight") else "linear_attention"
                     for i in range(layers)],
        num_attention_heads=attn_heads, num_key_value_heads=max(m.per_layer("attention.head_count_kv", layers)),
        head_dim=head_dim, rope_parameters=rope, linear_conv_kernel_dim=int(m.need("ssm.conv_kernel")),
        linear_key_head_dim=int(m.need("ssm.state_size")), linear_num_key_heads=int(m.need("ssm.group_count")),
        linear_num_value_heads=value_heads, linear_value_head_dim=inner // value_heads, rms_norm_eps=rms_eps(m),
        max_position_embeddings=int(m.get("context_length", 4096)), **m.common())
    if m.arch == "qwen35":
        return Qwen3_5TextConfig(intermediate_size=int(m.need("feed_forward_length")), **common)
    return Qwen3_5MoeTextConfig(
        num_experts=int(m.need("expert_count")), num_experts_per_tok=int(m.need("expert_used_count")),
        moe_intermediate_size=int(m.need("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(m.get("expert_shared_feed_forward_length", 0) or 0), **common)


def _first_ssm(m: Meta, kv: list[int], tensor: str) -> str:
    index = next((i for i, k in enumerate(kv) if k == 0), 0)
    return f"blk.{index}.{tensor}"


#: llama.cpp architecture name -> config builder
BUILDERS: dict[str, Callable[[Meta], Any]] = {
    "llama": _llama,
    "mamba": _mamba,
    "mamba2": _mamba2,
    "granitehybrid": _granite_hybrid,
    "nemotron_h": _nemotron_h,
    "nemotron_h_moe": _nemotron_h,
    "falcon-h1": _falcon_h1,
    "lfm2": _lfm2,
    "lfm2moe": _lfm2_moe,
    "jamba": _jamba,
    "qwen3next": _qwen3_next,
    "qwen35": _qwen3_5,
    "qwen35moe": _qwen3_5,
}


def file_dtype(types: dict[str, str]) -> str:
    """The model dtype ``dtype=auto`` gives a file of tensor ``types`` (name -> GGUF type): bfloat16 or float16
    when its weights are, float32 for an all-F32 file, bfloat16 for a quantized one (its norms are F32)."""
    kinds = set(types.values())
    for kind, dtype in (("BF16", "bfloat16"), ("F16", "float16")):
        if kind in kinds:
            return dtype
    return "float32" if kinds <= {"F32"} else "bfloat16"


def hf_config(values: dict[str, Any], types: dict[str, str], shapes: dict[str, tuple[int, ...]], file: str) -> Any:
    """The transformers config a GGUF file's metadata describes (``types``: tensor name -> GGUF type; ``shapes``:
    tensor name -> shape, numpy order); an architecture without a builder is a ValueError naming it and those
    that load."""
    m = Meta(values, shapes, file)
    builder = BUILDERS.get(m.arch)
    if builder is None:
        raise ValueError(f"{file}: GGUF architecture {m.arch!r} is not supported (supported: "
                         f"{', '.join(sorted(BUILDERS))})")
    try:
        config = builder(m)
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        if str(exc).startswith(file):
            raise
        raise ValueError(f"{file}: metadata does not describe a {m.arch} model ({type(exc).__name__}: {exc})") from None
    config.dtype = file_dtype(types)
    return config
