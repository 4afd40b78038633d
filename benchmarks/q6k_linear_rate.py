"""Milliseconds of one linear layer over a GGUF Q6_K weight per row count, side by side: the weight kept 6-bit
(``kernels/linear_w6k.py``), the same values as int8 codes with a float32 scale per 16 in-features on the 8-bit
kernel (``kernels/linear_w8.py``, group 16), and dequantized to bf16 on the bf16 kernel. The engines take turns
within each repeat (the median of the repeats is printed), each cycling through ``--distinct`` copies of its
weight so that every call reads it from memory, as a model's layers do.

    python benchmarks/q6k_linear_rate.py --threads 2 --k 2048 --n 100352 --rows 1,512
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=2048, help="in-features (a multiple of 256)")
    parser.add_argument("--n", type=int, default=2048, help="out-features")
    parser.add_argument("--rows", default="1,8,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    parser.add_argument("--distinct", type=int, default=2, help="distinct copies of each weight cycled through")
    parser.add_argument("--engines", default="q6k,int8,bf16", help="of q6k, int8, bf16")
    parser.add_argument("--level", default="auto", help="the ISA level to cap the kernels at (kernels/isa.py)")
    parser.add_argument("--dtype", default="bfloat16", help="activation dtype: bfloat16, float16 or float32")
    a = parser.parse_args()
    import torch

    from hybridserve.kernels import gemm, isa, linear_w6k, linear_w8
    from hybridserve.ops.linear_w6k import CODE_OFFSET, dequantize_w6k

    torch.set_num_threads(a.threads)
    isa.set_cap(a.level)
    act = getattr(torch, a.dtype)
    K, N = a.k, a.n
    g = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(a.distinct):
        codes = torch.randint(0, 64, (N, K), generator=g, dtype=torch.uint8)
        sub = torch.randint(-60, 60, (N, K // 16), generator=g, dtype=torch.int8)
        d = (torch.rand(N, K // 256, generator=g) / (500 * K ** 0.5)).half().float()
        weights.append((codes, sub, d))
    engines = a.engines.split(",")
    calls = {}
    if "q6k" in engines:
        packs = [linear_w6k.pack(*w) for w in weights]
        calls["q6k"] = [lambda x, p=p: linear_w6k.linear(x, p, N, None) for p in packs]
    if "int8" in engines:
        packs8 = []
        for codes, sub, d in weights:
            q = (codes.to(torch.int16) - CODE_OFFSET).to(torch.int8)
            scales = (d.repeat_interleave(16, dim=1) * sub.float()).contiguous()
            packs8.append(linear_w8.pack(q, scales, 16))
        calls["int8"] = [lambda x, p=p: linear_w8.linear(x, p, N, torch.int8, 16, None) for p in packs8]
    if "bf16" in engines:
        packs16 = [gemm.pack(dequantize_w6k(*w).to(act)) for w in weights]
        calls["bf16"] = [lambda x, p=p: gemm.linear(x, p, N, None) for p in packs16]
    del weights
    for rows in (int(r) for r in a.rows.split(",")):
        x = torch.randn(rows, K).to(act)
        times: dict[str, list[float]] = {e: [] for e in calls}
        for _ in range(a.repeats):
            for name, fns in calls.items():
                fns[0](x)
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < a.seconds:
                    fns[n % len(fns)](x)
                    n += 1
                times[name].append((time.perf_counter() - t0) / n * 1e3)
        parts = [f"{name} {statistics.median(ts):.3f} ms" for name, ts in times.items()]
        print(f"{isa.level_in_force()}, {a.dtype}, {rows} rows, K={K}, N={N}: " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
