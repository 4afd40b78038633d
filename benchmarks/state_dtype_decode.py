"""The recurrent state's share of one batched decode step, per state dtype: float32, bf16, int8, fp8 e4m3.

For the Mamba2 layers of a benchmark layout (``make_bench_model.py``: ``--size 100m``, 10 Mamba2 layers of 24
heads x 64 x 64; ``--size 1.3b``, 20 layers of 64 x 64 x 128), one decode step of ``--seqs`` sequences runs the
compiled scan kernel of every layer over its own pool of state slots (bf16 activations, float32 output), as the
decode step of a model does after its conv. What changes with the state dtype is this pass over the state
(read, update, write back; for 8 bits: decode, update, new row scale, seeded stochastic rounding), so its time
is what is compared. The dtypes run in turn, round after round, in an order rotated every round, so that each
round samples the same stretch of a shared machine's drifting speed: quote the per-round ratios' medians.

    python benchmarks/state_dtype_decode.py --size 100m --rounds 7
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from hybridserve.cache.state_codec import SCALE_DTYPE, CodedState
from hybridserve.kernels import recurrent, recurrent_coded

LAYOUTS = {"100m": dict(layers=10, H=24, P=64, N=64), "1.3b": dict(layers=20, H=64, P=64, N=128)}
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _pools(dtype: torch.dtype, layers: int, slots: int, shape: tuple[int, ...]) -> list:
    g = torch.Generator().manual_seed(0)
    pools: list[CodedState | torch.Tensor] = []
    for layer in range(layers):
        if dtype in recurrent_coded.CODE_DTYPES:
            codes = torch.randint(-100, 100, (slots, *shape), generator=g, dtype=torch.int8)
            if dtype != torch.int8:
                codes = (codes.float() * 0.25).to(dtype)
            scale = (torch.rand(slots, *shape[:-1], generator=g) * 0.01).to(SCALE_DTYPE)
            pools.append(CodedState(codes, scale, layer))
        else:
            pools.append((torch.randn(slots, *shape, generator=g) * 0.1).to(dtype))
    return pools


def _step(pools: list, inputs: tuple, cu: torch.Tensor, idx: torch.Tensor, keys: torch.Tensor,
          positions: torch.Tensor) -> None:
    x, dt, A, B, C, D, dt_bias, y = inputs
    for state in pools:
        if isinstance(state, CodedState):
            ok = recurrent_coded.mamba2_scan(state, x, dt, A, B, C, D, dt_bias, True, (0.0, math.inf), cu, idx, keys,
                                             positions, y)
        else:
            ok = recurrent.mamba2_scan(state, x, dt, A, B, C, D, dt_bias, True, (0.0, math.inf), cu, idx, y)
        assert ok, "the kernel declined the benchmark's call"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100m", choices=list(LAYOUTS))
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per dtype and round")
    parser.add_argument("--dtypes", default="float32,bf16,int8,fp8_e4m3")
    parser.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: torch's default)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lay = LAYOUTS[args.size]
    H, P, N, S = lay["H"], lay["P"], lay["N"], args.seqs
    g = torch.Generator().manual_seed(1)
    act = torch.bfloat16
    x, dt = torch.randn(S, H * P, generator=g).to(act), torch.randn(S, H, generator=g).to(act)
    B, C = torch.randn(S, N, generator=g).to(act), torch.randn(S, N, generator=g).to(act)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g), torch.randn(H, generator=g)
    inputs = (x, dt, A, B, C, D, dt_bias, torch.empty(S, H * P))
    cu = torch.arange(S + 1, dtype=torch.int64)
    idx = torch.randperm(S + 1, generator=g)[:S].contiguous()  # one slot in the pool left out, as padding would be
    keys, positions = torch.arange(S, dtype=torch.int64), torch.full((S,), 128, dtype=torch.int64)
    names = args.dtypes.split(",")
    pools = {n: _pools(DTYPES[n], lay["layers"], S + 1, (H, P, N)) for n in names}
    for n in names:  # warm-up (builds the kernels once)
        _step(pools[n], inputs, cu, idx, keys, positions)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                _step(pools[n], inputs, cu, idx, keys, positions)
            times[n].append((time.perf_counter() - start) / args.steps)
    ref = "bf16" if "bf16" in names else names[0]
    report = {"size": args.size, "seqs": S, "threads": torch.get_num_threads(), "layers": lay["layers"],
              "state_shape": [H, P, N], "ms_per_step_median": {n: 1e3 * statistics.median(t) for n, t in times.items()},
              f"ratio_to_{ref}_median": {n: statistics.median(a / b for a, b in zip(times[n], times[ref]))
                                         for n in names}}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
