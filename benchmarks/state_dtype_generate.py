"""Batched generation per recurrent-state dtype: the same requests on one engine per ``--mamba-ssm-cache-dtype``,
the engines in turn, the order reversed every round (a shared machine's drift lands on both alike).

    python benchmarks/state_dtype_generate.py --model /path/to/checkpoint --dtypes bfloat16,int8 --rounds 4
    python benchmarks/state_dtype_generate.py --model DIR --dtypes bfloat16:bfloat16,int8:bfloat16,int8:int8

Prints generated tokens per second per round and dtype, and each round's ratio to the first dtype. An entry
``SSM:CONV`` sets that engine's ``--mamba-cache-dtype`` (the conv state) too, as ``hybridserve drift`` reads it.
``--interleave-steps`` runs a round's requests on all engines at once, one engine step at a time in turn
(``interleaved_steps.py``): every dtype then samples the same seconds of a drifting shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hybridserve import LLM, SamplingParams
from hybridserve.evaluation.drift import run_dtypes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleaved_steps import interleaved_steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtypes", default="bfloat16,int8",
                    help="comma-separated --mamba-ssm-cache-dtype values (SSM:CONV sets the conv-state dtype too)")
    ap.add_argument("--dtype", default="bfloat16", help="the model dtype")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--interleave-steps", action="store_true", help="alternate the engines' steps one by one")
    args = ap.parse_args()
    names = args.dtypes.split(",")
    engines = {d: LLM(model=args.model, dtype=args.dtype, seed=0, **run_dtypes(d)) for d in names}
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 5 for j in range(args.prompt_tokens)]}
               for i in range(args.seqs)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels built, decode captured
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    rates: dict[str, list[float]] = {d: [] for d in names}
    for r in range(args.rounds):
        if args.interleave_steps:
            order = names if r % 2 == 0 else names[::-1]
            steps = interleaved_steps({d: engines[d].engine for d in order},
                                      [p["prompt_token_ids"] for p in prompts], params, f"r{r}")
            for d in names:
                rates[d].append(args.seqs * args.max_tokens / sum(steps[d]))
            continue
        for d in (names if r % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            outputs = engines[d].generate(prompts, params)
            seconds = time.perf_counter() - start
            rates[d].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    print(json.dumps({d: [round(x, 1) for x in v] for d, v in rates.items()}))
    for d in names[1:]:
        print(f"{d} / {names[0]} per round:", [round(a / b, 3) for a, b in zip(rates[d], rates[names[0]])])


if __name__ == "__main__":
    main()
