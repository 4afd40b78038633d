"""This machine's bf16 matmul rate at the benchmark model's decode shapes, with the weights cache-hot
(one weight per shape, reused) and cold (the model's distinct weights cycled, as in a decode step),
plus single-token (GEMV) weight-streaming bandwidth and the streaming read bandwidth
(``csrc/probe.cpp``); for oneDNN's prepacked
matmul and for hybridserve's own bf16 kernel (``hybridserve/kernels/csrc/gemm.cpp``), side by side.

    python benchmarks/matmul_rate.py --threads 2
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="rows of the decode matmuls (sequences)")
    a = parser.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    # (in, out) of the benchmark model's linear layers: 10 Mamba2 layers (in_proj, out_proj, MLP in/out)
    # and 2 attention layers (q, k, v, o, MLP in/out); the LM head is timed apart
    shapes = [(768, 3224), (1536, 768), (768, 4096), (2048, 768)] * 10
    shapes += [(768, 768), (768, 256), (768, 256), (768, 768), (768, 4096), (2048, 768)] * 2

    from hybridserve.kernels import gemm

    def rate(M: int, distinct: bool, engine: str) -> tuple[float, float]:
        weights, first = [], {}
        for k, n in shapes:
            w = first.get((k, n)) if not distinct else None
            if w is None:
                dense = torch.randn(n, k, dtype=torch.bfloat16)
                w = gemm.pack(dense) if engine == "kernel" else torch.ops.mkldnn._reorder_linear_weight(dense, M)
                first[(k, n)] = w
            weights.append(w)
        xs = {k: torch.randn(M, k, dtype=torch.bfloat16) for k, _ in shapes}

        def step() -> None:
            for (k, n), w in zip(shapes, weights):
                if engine == "kernel":
                    gemm.linear(xs[k], w, n, None)
                else:
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
        for _ in range(3):
            step()
        t = time.perf_counter()
        for _ in range(10):
            step()
        return (time.perf_counter() - t) / 10, sum(2 * M * k * n for k, n in shapes)

    nbytes = sum(2 * k * n for k, n in shapes)
    engines = ["oneDNN", "kernel"] if gemm.available() else ["oneDNN"]
    for engine in engines:
        for distinct in (False, True):
            secs, flops = rate(a.batch, distinct, engine)
            print(f"{engine:7s} M={a.batch} {'cold (distinct weights)' if distinct else 'hot (reused weights)'}: "
                  f"{secs * 1e3:.2f} ms per step, {flops / secs / 1e9:.0f} GFLOP/s")
        secs, _ = rate(1, True, engine)
        print(f"{engine:7s} M=1 (one token): {secs * 1e3:.2f} ms per step, "
              f"weights streamed at {nbytes / secs / 1e9:.1f} GB/s")
    import ctypes

    from hybridserve.kernels.build import load_library

    probe = load_library("probe")  # a streaming read by every thread (torch's sum is compute-bound here)
    if probe is not None:
        probe.hs_stream_read.restype = ctypes.c_uint64
        probe.hs_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        big = torch.ones(2 ** 28, dtype=torch.uint8)  # 256 MB
        probe.hs_stream_read(big.data_ptr(), big.numel())
        t = time.perf_counter()
        for _ in range(10):
            probe.hs_stream_read(big.data_ptr(), big.numel())
        print(f"read bandwidth (streaming read of 256 MB): "
              f"{big.numel() * 10 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
    x = torch.randn(2048, 2048, dtype=torch.bfloat16)
    x @ x
    t = time.perf_counter()
    for _ in range(10):
        x @ x
    print(f"bf16 2048^3 matmul: {2 * 2048 ** 3 * 10 / (time.perf_counter() - t) / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
