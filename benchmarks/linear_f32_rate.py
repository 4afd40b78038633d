"""The float32 linear kernel (``hybridserve/kernels/csrc/gemm.cpp``, packed weights) against
``torch.nn.functional.linear`` on the same float32 weights, at decode and prefill row counts: the
best of 5 timings of each, per shape, and their ratio.

    python benchmarks/linear_f32_rate.py --threads 2
"""

from __future__ import annotations

import argparse
import time

SHAPES = [(768, 256), (2048, 768), (768, 2048), (3072, 768), (32000, 768)]  # (out, in)
ROWS = [1, 8, 32, 64, 512]


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    import torch

    from hybridserve.kernels import gemm, isa

    torch.set_num_threads(a.threads)
    if not gemm.available():
        raise SystemExit("the linear kernels did not build here")
    print(f"CPU: {isa.cpu_info().model} | ISA level: {isa.level_in_force()} | {a.threads} threads")
    for n, k in SHAPES:
        w = torch.randn(n, k) / k ** 0.5  # (N, K)
        packed = gemm.pack(w)
        for m in ROWS:
            x = torch.randn(m, k)  # (M, K)
            reps = 10 if m * n * k > 2 ** 30 else 50
            t_torch = _best(lambda x=x, w=w: torch.nn.functional.linear(x, w), reps)
            t_kernel = _best(lambda x=x, p=packed, n=n: gemm.linear(x, p, n, None), reps)
            print(f"{n:>6} x {k:<5} rows {m:>4}: torch {t_torch * 1e6:9.1f} us  kernel {t_kernel * 1e6:9.1f} us  "
                  f"{t_torch / t_kernel:5.2f}x")


if __name__ == "__main__":
    main()
