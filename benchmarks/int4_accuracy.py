"""Mean |Δlogprob| of weight quantizations against bf16 over a long text: for every position of the text, the
logprob each engine gives the text's next token (``prompt_logprobs``), against the bf16 engine's, averaged.
Engines: int8, int4 in groups of 32, 64 and 128, and int4 with the LM head in int8 (``INT4_LM_HEAD_BITS``).

    python benchmarks/int4_accuracy.py --model default --text docs/architecture.md --tokens 1024
    python benchmarks/int4_accuracy.py --model /tmp/ckpt --tokens 1024   # no tokenizer: random token ids

``--chunk N`` prefills the text N tokens per step (``max_num_batched_tokens``), so that every linear call has the
row count of a decode step: at 8 or fewer the 4-bit linears run on W4A8 where the CPU has VNNI (activations
quantized to int8, docs/quantization.md), as one stream's decode does; the default, one chunk, runs the
many-row paths (weights dequantized, activations as they are).
"""

from __future__ import annotations

import argparse
import json
import statistics


def _token_ids(model: str, text: str | None, tokens: int, vocab: int) -> list[int]:
    import torch

    if text is not None:
        from transformers import AutoTokenizer

        with open(text) as f:
            ids = AutoTokenizer.from_pretrained(model).encode(f.read())
        return ids[:tokens]
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (tokens,), generator=g).tolist()


def _logprobs(model: str, ids: list[int], quantization: str, group: int | None, chunk: int) -> list[float]:
    from hybridserve import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", quantization=quantization, quantization_group_size=group,
              cache_memory="256MiB", max_model_len=len(ids) + 8, max_num_batched_tokens=chunk,
              enable_progress_bar=False)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    return [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint folder, or 'default' (the shipped model)")
    parser.add_argument("--text", default=None, help="a text file (with the model's tokenizer); else random ids")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=0,
                        help="prompt tokens per prefill step (0: the whole text in one step)")
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    from hybridserve.layers import packed_linear

    model = a.model
    if model == "default":
        from hybridserve.default_model import default_model_path

        model = default_model_path()
    from transformers import AutoConfig

    ids = _token_ids(model, a.text, a.tokens, AutoConfig.from_pretrained(model).vocab_size)
    chunk = a.chunk or len(ids) + 8
    reference = _logprobs(model, ids, "none", None, chunk)
    runs = {"int8": ("int8", None, 4), "int4 g32": ("int4", 32, 4), "int4 g64": ("int4", 64, 4),
            "int4 g128": ("int4", 128, 4), "int4 g32, LM head int8": ("int4", 32, 8)}
    results = {}
    for label, (quantization, group, head_bits) in runs.items():
        packed_linear.INT4_LM_HEAD_BITS = head_bits
        lp = _logprobs(model, ids, quantization, group, chunk)
        results[label] = statistics.fmean(abs(x - y) for x, y in zip(lp, reference))
        print(f"{label:24s} mean |dlogprob| {results[label]:.4f} over {len(lp)} tokens", flush=True)
    packed_linear.INT4_LM_HEAD_BITS = 4
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "text": a.text, "tokens": len(ids), "chunk": a.chunk,
                       "mean_abs_dlogprob": results}, f, indent=1)


if __name__ == "__main__":
    main()
