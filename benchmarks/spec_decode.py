"""One stream with and without speculative decoding, side by side in one process, repeats interleaved.

    python benchmarks/spec_decode.py                      # the shipped default model, n-gram drafts
    python benchmarks/spec_decode.py --model DIR --speculative-config '{"model": "SMALL_DIR"}'

For each case (greedy from a story opening, whose continuation repeats; greedy from random token ids; and
sampling at temperature 1, which repeats little) it prints tokens/s without and with speculation (median of
the interleaved repeats), their ratio, whether the greedy tokens are identical (sampled streams differ: the
rejection rule draws other random numbers), and the speculation counters.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from hybridserve import LLM, SamplingParams


def _run(llm: LLM, prompt: dict, params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return len(out.token_ids) / (time.perf_counter() - start), out.token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 5}')
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the figures to this file too")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    opts = {"enable_progress_bar": False}
    plain = LLM(args.model, **opts)
    spec = LLM(args.model, speculative_config=args.speculative_config, **opts)
    tok = plain.get_tokenizer()
    vocab = plain.engine.hf_config.vocab_size
    rng = random.Random(0)
    prompts = {"repeating (story opening)": {"prompt_token_ids": tok.encode("Once upon a time") if tok else [1, 2, 3]},
               "random token ids": {"prompt_token_ids": [rng.randrange(vocab) for _ in range(32)]}}
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True)
    cases = [(name, prompt, greedy) for name, prompt in prompts.items()]
    cases.append(("sampled at temperature 1 (few repeats)", prompts["repeating (story opening)"], sampled))
    results = {}
    for name, prompt, params in cases:
        _run(plain, prompt, params), _run(spec, prompt, params)  # warm both
        before = spec.engine.speculator.stats.as_dict()
        rates_plain, rates_spec, same = [], [], True
        for _ in range(args.repeats):
            rate, want = _run(plain, prompt, params)
            rates_plain.append(rate)
            rate, got = _run(spec, prompt, params)
            rates_spec.append(rate)
            same = (same and got == want) if params.greedy else None
        after = spec.engine.speculator.stats.as_dict()
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
        a, b = statistics.median(rates_plain), statistics.median(rates_spec)
        results[name] = {"plain_tok_s": round(a, 1), "spec_tok_s": round(b, 1), "speedup": round(b / a, 3),
                         "identical_tokens": same, "verifications": drafts, "draft_tokens": proposed,
                         "accepted_tokens": accepted,
                         "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else 0.0,
                         "accepted_length_counts": [x - y for x, y in zip(after["accepted_length_counts"],
                                                                          before["accepted_length_counts"])]}
        print(f"{name}: {a:.0f} -> {b:.0f} tok/s ({b / a:.2f}x), identical tokens: {same}; "
              f"{drafts} verifications, {accepted}/{proposed} drafts accepted", flush=True)
    print(json.dumps({"speculative_config": json.loads(args.speculative_config), "results": results}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
