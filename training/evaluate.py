"""Check a saved default-model checkpoint: load it with the `Auto*` classes, score held-out
perplexity, and print greedy and sampled continuations.

Usage:  python training/evaluate.py [--model hybridserve/default_model] [--val-file training/data/val.txt]
"""
from __future__ import annotations

import argparse
import math
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=os.path.join(ROOT, "hybridserve", "default_model"))
    ap.add_argument("--val-file", default=os.path.join(HERE, "data", "val.txt"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}  {n_params:,} params  dtype {next(model.parameters()).dtype}")

    if os.path.exists(args.val_file):
        ids = tok(open(args.val_file, encoding="utf-8").read(), add_special_tokens=False, verbose=False)["input_ids"]
        ids = torch.tensor(ids)
        T = args.seq_len
        n = (len(ids) - 1) // T
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, n, 16):
                rows = range(i, min(i + 16, n))
                x = torch.stack([ids[j * T : j * T + T] for j in rows])
                y = torch.stack([ids[j * T + 1 : j * T + T + 1] for j in rows])
                logits = model(input_ids=x, use_cache=False).logits.float()
                total += torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
                count += y.numel()
        loss = total / count
        print(f"held-out: {count:,} tokens, loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f}")

    prompts = ["Once upon a time", "It is a truth universally acknowledged", "The weather was"]
    for p in prompts:
        x = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            g = model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                               repetition_penalty=1.0)
        print(f"\n[greedy] {tok.decode(g[0], skip_special_tokens=True)!r}")
    torch.manual_seed(args.seed)
    for p in prompts[:1] * 3:
        x = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            g = model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.8, top_k=50,
                               pad_token_id=tok.pad_token_id)
        print(f"\n[sampled T=0.8 top_k=50 seed={args.seed}] {tok.decode(g[0], skip_special_tokens=True)!r}")
    chat = tok.apply_chat_template([{"role": "user", "content": "Tell me about Mr. Darcy."}],
                                   tokenize=False, add_generation_prompt=True)
    print(f"\nchat template renders: {chat!r}")


if __name__ == "__main__":
    main()
