"""One causal conv call of a batched decode step over bf16 and over int8 conv state, alternated.

    python benchmarks/conv_state_kernel.py [--cpu-isa avx2] [--channels 1792 4352] [--seqs 32]

Prints the mean microseconds per call of each round (--calls calls) for each state dtype.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridserve.cache.conv_codec import CodedConvState, encode_conv
from hybridserve.kernels import isa
from hybridserve.kernels import recurrent as recurrent_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", type=int, nargs="+", default=[1792, 4352])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--kernel", type=int, default=4)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-isa", default=None, help="cap the kernels' ISA level (e.g. avx2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cpu_isa:
        isa.set_cap(args.cpu_isa)
    for channels in args.channels:
        seqs, width = args.seqs, args.kernel - 1
        values = torch.randn(2 * seqs, channels, width)  # (slots, D, K-1)
        states = {"bfloat16": values.bfloat16(), "int8": CodedConvState(*encode_conv(values), layer=0)}
        x = torch.randn(seqs, channels).bfloat16()
        weight_t = torch.randn(args.kernel, channels).contiguous()
        bias = torch.randn(channels)
        slots, cu = torch.arange(seqs), torch.arange(seqs + 1)
        out = torch.empty(seqs, channels, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in states}
        for _ in range(args.rounds):
            for name, state in states.items():
                for _ in range(20):
                    recurrent_kernels.causal_conv1d(x, state, weight_t, bias, cu, slots, "silu", out=out)
                start = time.perf_counter()
                for _ in range(args.calls):
                    recurrent_kernels.causal_conv1d(x, state, weight_t, bias, cu, slots, "silu", out=out)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        print(f"{channels} channels, {seqs} sequences:",
              ", ".join(f"{name} {' / '.join(f'{t:.1f}' for t in ts)} us" for name, ts in times.items()))


if __name__ == "__main__":
    main()
