"""Host time per decode step for a tiny checkpoint of every family (the test suite's builders), each through
``benchmarks/profile_step.py``: Python and small ops outside the compiled kernel calls.

    python benchmarks/host_time_families.py --requests 32 --repeats 3
    python benchmarks/host_time_families.py --requests 32 --repeats 3 --cpu-isa avx2   # the AVX2 variants

Prints one line per family with every run's figure and their minimum (the runs are noisy: take the minimum).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from tests.checkpoints import BUILDERS, make  # noqa: E402


def host_time_ms(path: str, requests: int, prompt_len: int, steps: int, cpu_isa: str = "auto") -> float | None:
    """The last line of profile_step.py, in ms; None if it failed."""
    cmd = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "profile_step.py"), "--model", path,
           "--requests", str(requests), "--prompt-len", str(prompt_len), "--steps", str(steps), "--cpu-isa", cpu_isa]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("host time per step")]
    return float(lines[-1].rsplit(":", 1)[1].split()[0]) if lines else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", nargs="*", default=sorted(BUILDERS))
    parser.add_argument("--cpu-isa", default="auto", help="cap the ISA of every run (e.g. avx2 on an AVX-512 CPU)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {family: make(tmp, family, dtype=torch.bfloat16) for family in args.families}
        runs: dict[str, list[float | None]] = {family: [] for family in args.families}
        for _ in range(args.repeats):  # interleaved: every family once per round
            for family in args.families:
                runs[family].append(host_time_ms(paths[family], args.requests, args.prompt_len, args.steps,
                                                 args.cpu_isa))
    for family in args.families:
        got = [t for t in runs[family] if t is not None]
        figures = ", ".join("failed" if t is None else f"{t:.2f}" for t in runs[family])
        print(f"{family:24s} min {min(got):.2f} ms  ({figures})" if got else f"{family:24s} failed")


if __name__ == "__main__":
    main()
