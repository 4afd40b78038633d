"""Per family, how far int8 conv state drifts from float32 state, beside bfloat16 conv state (tiny checkpoints).

    python benchmarks/conv_state_drift.py --family mamba2 qwen3_next lfm2 --json OUT.json

For each family's tiny checkpoint (``tests/checkpoints.py``, float32), ``hybridserve drift``'s measurement
(``evaluation/drift.py``): 520 random prompt tokens and 520 tokens a float32-state run generates, scored one token
per step, against all-float32 state, for the ``SSM:CONV`` pairs of ``--pairs`` (temporal : conv dtypes). Prints
the mean |Δlogprob| per pair and the ratio of int8 conv to bfloat16 conv.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridserve.evaluation.drift import DriftSettings, measure_drift  # noqa: E402

DEFAULT_PAIRS = ["float32:bfloat16", "float32:int8", "bfloat16:bfloat16", "int8:int8"]


def main() -> None:
    from tests.checkpoints import make

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", nargs="+", required=True)
    ap.add_argument("--pairs", nargs="+", default=DEFAULT_PAIRS)
    ap.add_argument("--tokens", type=int, default=520, help="prompt tokens, and as many generated")
    ap.add_argument("--checkpoints", default="/tmp/hybridserve-conv-drift", help="where the tiny checkpoints go")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {}
    for family in args.family:
        path = make(args.checkpoints, family)
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompt = torch.randint(3, vocab, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        report = measure_drift(path, args.pairs, prompt, DriftSettings(args.tokens, args.tokens, 2 * args.tokens),
                               {"cache_memory": "64MiB", "max_model_len": 2 * args.tokens + 16,
                                "mamba_cache_dtype": "float32"})
        means = {name: run["all"]["mean"] for name, run in report["state_dtypes"].items()}
        results[family] = means
        ratio = (means.get("float32:int8", 0.0) / means["float32:bfloat16"]
                 if means.get("float32:bfloat16") else float("nan"))
        print(family, " ".join(f"{k} {v:.3g}" for k, v in means.items()), f"int8/bf16 conv {ratio:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "mean_abs_logprob": results}, f, indent=1)


if __name__ == "__main__":
    main()
