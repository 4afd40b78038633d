"""int8 state drift with stochastic and with nearest rounding on a checkpoint whose decays are made slow.

    python benchmarks/rounding_slow_decay.py --model DIR --a-log -4 [--kinds gated_delta_net kda]

Copies the checkpoint with every ``*.A_log`` parameter set to ``--a-log`` (decays of the gated delta net and KDA
close to 1, as trained models have in some channels), then measures mean |Δlogprob| against float32 state over
``--prompt-tokens`` random prompt tokens and as many generated ones, one token per step, for bfloat16 state and
for int8 state rounded each way (``cache/spec.py: TEMPORAL_ROUNDING`` set for ``--kinds``; docs/state_precision.md,
"Rounding").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from hybridserve.cache import spec
from hybridserve.evaluation.drift import DriftSettings, measure_drift


def slowed_copy(model: str, a_log: float, folder: str) -> int:
    """Copy ``model`` into ``folder`` with every ``A_log`` tensor filled with ``a_log``; returns how many."""
    shutil.copytree(model, folder, dirs_exist_ok=True)
    changed = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(folder, name))
            for key in tensors:
                if key.endswith("A_log"):
                    tensors[key] = torch.full_like(tensors[key], a_log)
                    changed += 1
            save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--a-log", type=float, default=-4.0)
    ap.add_argument("--kinds", nargs="+", default=["gated_delta_net", "kda", "mlstm"])
    ap.add_argument("--prompt-tokens", type=int, default=520)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print(f"A_log set in {slowed_copy(args.model, args.a_log, folder)} tensors")
        with open(os.path.join(folder, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        settings = DriftSettings(prompt_tokens=args.prompt_tokens, generate_tokens=args.prompt_tokens,
                                 bucket=2 * args.prompt_tokens)
        saved = dict(spec.TEMPORAL_ROUNDING)
        try:
            for rounding in ("stochastic", "nearest"):
                spec.TEMPORAL_ROUNDING.clear()
                spec.TEMPORAL_ROUNDING.update({kind: rounding for kind in args.kinds})
                report = measure_drift(folder, ["bfloat16", "int8"], prompt, settings,
                                       {"cache_memory": "64MiB", "max_model_len": 2 * args.prompt_tokens + 16})
                means = {name: run["all"]["mean"] for name, run in report["state_dtypes"].items()}
                print(f"int8 {rounding}: {means['int8']:.4g}, bfloat16 {means['bfloat16']:.4g}, "
                      f"ratio {means['int8'] / means['bfloat16']:.2f}")
        finally:
            spec.TEMPORAL_ROUNDING.clear()
            spec.TEMPORAL_ROUNDING.update(saved)


if __name__ == "__main__":
    main()
