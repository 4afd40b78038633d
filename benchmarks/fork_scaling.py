"""Offline ``n > 1`` at growing ``n``: seconds per completion should stay flat (no per-step scans of a
request's sequences, no quadratic queue removals).

    python benchmarks/fork_scaling.py --n 100 1000 10000
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--n", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--max-tokens", type=int, default=5)
    a = parser.parse_args()
    from hybridserve import LLM, SamplingParams
    from hybridserve.kernels import isa

    llm = LLM(a.model, max_model_len=128, enable_progress_bar=False)
    print(f"CPU: {isa.cpu_info().model} | ISA level: {isa.level_in_force()}")
    for n in a.n:
        start = time.perf_counter()
        out = llm.generate(["Hi"], SamplingParams(n=n, seed=1, max_tokens=a.max_tokens))[0]
        seconds = time.perf_counter() - start
        assert len(out.outputs) == n
        print(f"n={n:>6}: {seconds:7.2f} s  ({1e3 * seconds / n:.2f} ms per completion)")
        assert llm.engine.pool.usage() == 0


if __name__ == "__main__":
    main()
