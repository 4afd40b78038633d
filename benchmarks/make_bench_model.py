"""Build the checkpoints used by the speed benchmarks: ~100M parameters, or ~1.3B with ``--size 1.3b``.

Granite-4.0-H layout (GraniteMoeHybridForCausalLM: Mamba2 and attention, dense shared MLP) by
default, since vLLM's CPU build implements it natively; ``--arch bamba`` gives the same dimensions in
Bamba's layout; ``--arch mamba2`` a pure Mamba2 (Mamba2ForCausalLM, 20 layers of the same mixer);
``--arch qwen3_next`` a Qwen3-Next-like model (gated delta net layers, one gated attention layer in
four, 16 routed experts top-2 plus a shared expert in every layer).

``--size 1.3b`` (granite and bamba) is the real-size Granite-4.0-H layout: hidden 2048, 24 layers (20
Mamba2 + 4 attention, at 3, 9, 15, 21), 32 attention heads of 64 with 8 KV heads and no positional
encoding, Mamba2 with 64 heads of 64 (expand 2), state 128, chunk 256, a dense MLP of 3584 in every
layer, Granite's 100352-token vocab, tied embeddings: 1.29B parameters (2.6 GB in bf16, ~2.6 GFLOP a
token). The default ``--size 100m`` is the ~120M layout the benchmarks have always used.

Random weights with a scaled LM head (peaky logits, stable greedy decoding), saved in bf16. No
tokenizer is written (the benchmarks feed token ids; make_gguf.py makes one for llama.cpp).

    python benchmarks/make_bench_model.py /tmp/bench-bamba-100m --arch bamba
    python benchmarks/make_bench_model.py /tmp/bench-granite-1.3b --size 1.3b
"""

from __future__ import annotations

import argparse

import torch

# the dimensions of the hybrid (granite, bamba) layouts at each --size: one attention layer in six,
# the first at index 3; attention heads and Mamba2 heads of 64
SIZES = {
    "100m": {"vocab": 32000, "hidden": 768, "mlp": 2048, "layers": 12, "heads": 12, "kv_heads": 4,
             "mamba_heads": 24, "d_state": 64, "chunk": 128},
    "1.3b": {"vocab": 100352, "hidden": 2048, "mlp": 3584, "layers": 24, "heads": 32, "kv_heads": 8,
             "mamba_heads": 64, "d_state": 128, "chunk": 256},
}


def _attention_layers(layers: int) -> list[int]:
    return list(range(3, layers, 6))


def granite_config(size: str = "100m"):
    from transformers import GraniteMoeHybridConfig

    d = SIZES[size]
    kinds = ["linear_attention"] * d["layers"]
    for i in _attention_layers(d["layers"]):
        kinds[i] = "full_attention"
    return GraniteMoeHybridConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["mlp"],
        shared_intermediate_size=d["mlp"], num_local_experts=0, num_experts_per_tok=0,
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
        layer_types=kinds, position_embedding_type="nope", mamba_n_heads=d["mamba_heads"], mamba_d_head=64,
        mamba_d_state=d["d_state"], mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=d["chunk"],
        max_position_embeddings=8192, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def bamba_config(size: str = "100m"):
    from transformers import BambaConfig

    d = SIZES[size]
    return BambaConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["mlp"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], head_dim=64,
        attn_layer_indices=_attention_layers(d["layers"]), mamba_n_heads=d["mamba_heads"], mamba_d_head=64,
        mamba_d_state=d["d_state"], mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=d["chunk"],
        max_position_embeddings=8192, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def mamba2_config():
    from transformers import Mamba2Config

    return Mamba2Config(
        vocab_size=32000, hidden_size=768, num_hidden_layers=20, num_heads=24, head_dim=64, state_size=64,
        n_groups=1, conv_kernel=4, expand=2, chunk_size=128, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def qwen3_next_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=32000, hidden_size=768, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True, intermediate_size=1024,
        max_position_embeddings=8192, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


CONFIGS = {"granite": granite_config, "bamba": bamba_config, "mamba2": mamba2_config, "qwen3_next": qwen3_next_config}
SIZED = ("granite", "bamba")  # the layouts --size applies to


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", default="granite", choices=list(CONFIGS))
    parser.add_argument("--size", default="100m", choices=list(SIZES),
                        help=f"model size, for --arch {' / '.join(SIZED)} (the others are ~100M only)")
    args = parser.parse_args()
    if args.size != "100m" and args.arch not in SIZED:
        parser.error(f"--size {args.size} is for --arch {' or '.join(SIZED)}")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    config = CONFIGS[args.arch](args.size) if args.arch in SIZED else CONFIGS[args.arch]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
        base = model.backbone if hasattr(model, "backbone") else model.model
        final_norm = next(getattr(base, n) for n in ("norm", "final_layernorm", "norm_f") if hasattr(base, n))
        if config.model_type == "qwen3_next":  # its norm weights are stored as gamma - 1 (zeros at init)
            final_norm.weight.add_(7.0)
        else:
            final_norm.weight.mul_(8.0)  # tied head: sharpen logits through the final norm
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.path)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {args.path}: {n / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
