"""GFLOP/s of one linear layer per row count, side by side: hybridserve's bf16 kernel at each ISA level of
``--levels`` this CPU runs (the AMX tiles at ``amx``, AVX-512 BF16 dot products at avx512_bf16), its 8-bit
weights (int8 codes, weight-only and W8A8) and 4-bit weights (``--int4 GROUP``) likewise, torch's bf16
``linear`` (oneDNN; AMX brgemm where the CPU has it) and torch's float32 ``linear``. The engines take turns
within each repeat; the median of the repeats is printed.

    python benchmarks/linear_rate.py --threads 2 --k 2048 --n 2048
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=2048, help="in-features")
    parser.add_argument("--n", type=int, default=2048, help="out-features")
    parser.add_argument("--rows", default="1,8,16,32,128,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.2, help="time per measurement")
    parser.add_argument("--int8", action="store_true", help="also time the int8 weight kernels (weight-only and W8A8)")
    parser.add_argument("--int4", type=int, default=0, metavar="GROUP",
                        help="also time the 4-bit weight kernel, centred codes in groups of GROUP in-features with "
                             "sub-scaled scales (as --quantization int4 makes them)")
    parser.add_argument("--int4-f16", action="store_true",
                        help="with --int4, also time the same codes with float16 scales (GGUF Q4_0's form)")
    parser.add_argument("--distinct", type=int, default=1,
                        help="cycle through this many distinct weights (enough to exceed the last-level cache: "
                             "each call reads its weight from memory, as a model's layers do)")
    parser.add_argument("--levels", default="avx512_bf16,amx",
                        help="the ISA levels to time the kernels at (those this CPU runs; W8A8 sums on integer "
                             "vectors below avx512_bf16, on AVX-512 VNNI there, on AMX-INT8 tiles at amx)")
    parser.add_argument("--json", help="write the medians here")
    a = parser.parse_args()
    import torch

    from hybridserve.kernels import gemm, isa, linear_w4, linear_w8
    from hybridserve.layers.linear_w4 import quantize_w4_f16, quantize_w4_sub
    from hybridserve.ops.linear_w8 import quantize_int8

    torch.set_num_threads(a.threads)
    K, N = a.k, a.n
    ws = [(torch.randn(N, K) / K ** 0.5).bfloat16() for _ in range(a.distinct)]
    w32s = [w.float() for w in ws]
    packs = [gemm.pack(w) for w in ws]
    packs8 = [linear_w8.pack(*quantize_int8(w, 0), 0) for w in ws] if a.int8 else []
    packs4 = [linear_w4.pack(c, s, None, a.int4, supers=(d, None))
              for c, s, d in (quantize_w4_sub(w, a.int4) for w in ws)] if a.int4 else []
    packs4_f16 = [linear_w4.pack(*quantize_w4_f16(w, a.int4), None, a.int4) for w in ws] if a.int4_f16 else []
    turn = [0]

    def nxt(items):  # the next of the distinct weights, in turn
        turn[0] += 1
        return items[turn[0] % len(items)]
    levels = [isa.check_level(lv) for lv in a.levels.split(",") if isa.cpu_info().supports(lv)]
    if not levels:
        levels = [isa.level_in_force()]

    def timed(fn) -> float:
        fn()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            fn()
            n += 1
        return (time.perf_counter() - t0) / n

    def engines(x):
        out = {}
        for lv in levels:
            def run(lv=lv):
                isa.set_cap(lv)
                gemm.linear(x, nxt(packs), N, None)
            out[f"kernel {lv}"] = run
            if a.int8:
                def run8(lv=lv):
                    isa.set_cap(lv)
                    linear_w8.linear(x, nxt(packs8), N, torch.int8, 0, None)
                out[f"int8 {lv}"] = run8

                def run_w8a8(lv=lv):
                    isa.set_cap(lv)
                    linear_w8.linear_w8a8(x, nxt(packs8), N, None)
                out[f"w8a8 {lv}"] = run_w8a8
            if a.int4:
                def run4(lv=lv):
                    isa.set_cap(lv)
                    linear_w4.linear(x, nxt(packs4), N, a.int4, False, None, sub_scaled=True)
                out[f"int4 {lv}"] = run4
            if a.int4 and a.int4_f16:
                def run4_f16(lv=lv):
                    isa.set_cap(lv)
                    linear_w4.linear(x, nxt(packs4_f16), N, a.int4, False, None)
                out[f"int4-f16 {lv}"] = run4_f16
        out["torch bf16"] = lambda: torch.nn.functional.linear(x, nxt(ws))
        x32 = x.float()
        out["torch f32"] = lambda: torch.nn.functional.linear(x32, nxt(w32s))
        return out

    results: dict[str, dict[int, float]] = {}
    print(f"CPU: {isa.cpu_info().model}; best level {isa.cpu_info().best_level}; {a.threads} threads; K={K} N={N}; "
          f"{a.distinct} distinct weight(s)")
    for M in (int(r) for r in a.rows.split(",")):
        x = torch.randn(M, K).bfloat16()
        runs = engines(x)
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(a.repeats):
            for name, fn in runs.items():
                samples[name].append(2 * M * N * K / timed(fn) / 1e9)
        for name, s in samples.items():
            results.setdefault(name, {})[M] = statistics.median(s)
        print(f"rows {M:5d}: " + "  ".join(f"{name} {statistics.median(s):7.1f}" for name, s in samples.items()))
    isa.set_cap("auto")
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"cpu": isa.cpu_info().model, "threads": a.threads, "K": K, "N": N, "distinct": a.distinct,
                       "gflops": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
