"""GGUF files from llama.cpp's own converter and quantizer against the safetensors checkpoint they come from.

For each family: a tiny random bf16 checkpoint (tests/checkpoints.py's layout at hidden 256, vocab 4096, init
std 0.03) is converted to BF16 GGUF by make_gguf.py (llama.cpp's convert_hf_to_gguf), quantized to Q8_0 and
Q4_K_M by ``llama-quantize``, and each file is run with ``dtype=auto``. Printed per file: whether its greedy
tokens (two prompts, 16 tokens each) equal the checkpoint's bf16 run, and the mean |Δlogprob| of the text's
tokens, teacher-forced over 255 tokens of a random-id text (``prompt_logprobs``). These are the figures of
docs/gguf.md.

    python benchmarks/gguf_accuracy.py qwen3_5 lfm2_moe --llama-cpp /root/peers/llama.cpp --work /tmp/gguf-acc

Run it with a Python that has the converter's needs (make_gguf.py's docstring) and the project on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDE = {"vocab_size": 4096, "hidden_size": 256}
#: per family, the sizes beside WIDE that keep its tiny test layout consistent at hidden 256
SIZES: dict[str, dict] = {
    "llama": dict(intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "jamba": dict(intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, mamba_dt_rank=16),
    "bamba": dict(intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                  mamba_d_head=64),
    # llama.cpp's LFM2-MoE has no output tensor: the LM head is the embedding
    "lfm2_moe": dict(intermediate_size=512, moe_intermediate_size=256, tie_word_embeddings=True),
    "qwen3_5": dict(intermediate_size=512, linear_key_head_dim=64, linear_value_head_dim=64, head_dim=64),
    "qwen3_5_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256, linear_key_head_dim=64,
                        linear_value_head_dim=64, head_dim=64),
}
#: families whose checkpoints have no multi-token-prediction layers the converter would look for
NO_MTP = {"qwen3_5", "qwen3_5_moe"}
QUANTS = ("Q8_0", "Q4_K_M")
PROMPTS = [[5, 9, 33, 4, 7], list(range(3, 22))]


def make_files(family: str, folder: str, llama_cpp: str) -> None:
    """The checkpoint, its BF16 GGUF and the quantized ones in ``folder`` (each made once)."""
    import torch

    sys.path.insert(0, REPO)
    from tests import checkpoints

    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        config = checkpoints.BUILDERS[family](**WIDE, **SIZES.get(family, {}))
        checkpoints.build(config, folder, std=0.03, dtype=torch.bfloat16)
    bf16 = os.path.join(folder, "model-bf16.gguf")
    if not os.path.isfile(bf16):
        subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "make_gguf.py"), folder, "--llama-cpp",
                        llama_cpp, "--outtype", "bf16", *(["--no-mtp"] if family in NO_MTP else [])], check=True)
    for quant in QUANTS:
        out = os.path.join(folder, f"model-{quant}.gguf")
        if not os.path.isfile(out):
            subprocess.run([os.path.join(llama_cpp, "build", "bin", "llama-quantize"), bf16, out, quant], check=True,
                           stdout=subprocess.DEVNULL)


def run(path: str, text: list[int], **options) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens of PROMPTS and the teacher-forced logprobs of ``text[1:]``."""
    from hybridserve import LLM, SamplingParams

    llm = LLM(path, cache_memory="64MiB", max_num_seqs=2, enable_progress_bar=False, **options)
    greedy = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                             SamplingParams(max_tokens=16, temperature=0.0))]
    scored = llm.generate([{"prompt_token_ids": text}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return greedy, [step[token].logprob for step, token in zip(scored.prompt_logprobs[1:], text[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="+", choices=sorted(SIZES))
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_SRC", "/work/llama.cpp"),
                        help="llama.cpp source folder with build/bin/llama-quantize built")
    parser.add_argument("--work", default="/tmp/gguf-accuracy", help="where the checkpoints and files go")
    a = parser.parse_args()
    import torch

    text = torch.randint(3, WIDE["vocab_size"], (256,), generator=torch.Generator().manual_seed(0)).tolist()
    for family in a.families:
        folder = os.path.join(a.work, family)
        make_files(family, folder, os.path.abspath(a.llama_cpp))
        reference, reference_logprobs = run(folder, text, dtype="bfloat16")
        for kind in ("bf16", *QUANTS):
            greedy, logprobs = run(os.path.join(folder, f"model-{kind}.gguf"), text)
            delta = sum(abs(x - y) for x, y in zip(reference_logprobs, logprobs)) / len(logprobs)
            print(f"{family} {kind}: greedy tokens {'equal' if greedy == reference else 'differ'}, "
                  f"mean |dlogprob| {delta:.3f}", flush=True)


if __name__ == "__main__":
    main()
