"""A batched decode step on cores shared with another process: each OpenMP wait policy (and thread count),
on a quiet machine and beside a busy neighbour, interleaved.

    python benchmarks/make_bench_model.py /tmp/bench-granite-100m
    python benchmarks/shared_cores.py --model /tmp/bench-granite-100m
    python benchmarks/shared_cores.py --model DIR --configs bounded,bounded@1,spins=3000 --rounds 5

A configuration is ``POLICY[@THREADS][+adaptive]``: a ``--cpu-wait-policy`` value (spin, bounded, passive,
openmp, auto) or ``spins=N`` (``GOMP_SPINCOUNT=N``, to explore), a thread count (default: every core), and
``+adaptive`` for ``--cpu-adaptive-threads`` (the count each step ran with is in the JSON). Each one
runs in a fresh process, since the OpenMP runtime reads its wait policy when torch is imported: the child
applies the policy as the ``hybridserve`` command does (``kernels/threads.py``) before importing torch,
prefills ``--requests`` random prompts, steps until every request decodes, then alternates ``--steps``
timed decode steps on the quiet machine and ``--steps`` beside a busy neighbour (a one-thread busy loop in
a subprocess at normal priority, started for the phase and killed at its end; ``--neighbours`` of them),
``--phases`` times each.
Every round runs the configurations in a rotated order. Printed per configuration: the median step time
quiet and busy (the median of the rounds' medians, and the range of those), and busy / quiet; per run, the
other load: the CPU time the rest of the machine (other processes, the hypervisor's steal time) took
during a phase, in cores (the most of any phase), from /proc/stat.

This measures; it asserts nothing. On a shared host, ``--max-other-load`` waits (up to ``--quiet-wait``
seconds) for the machine to be that quiet before each run, and reruns a configuration whose phases saw
more load than that from outside, up to ``--retries`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from hybridserve.kernels.thread_share import busy_ticks  # (no torch import: the child sets its wait policy first)

NEIGHBOUR = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (steal time included), from /proc/stat."""
    with open("/proc/stat") as f:
        text = f.read()
    return busy_ticks(set(range(os.cpu_count() or 1)), text) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (every thread), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(threshold: float, limit: float, window: float = 3.0) -> float:
    """Wait (at most ``limit`` seconds) for a ``window`` in which the machine's busy CPU time is below
    ``threshold`` cores; the load of the last window."""
    deadline = time.monotonic() + limit
    while True:
        before, t = busy_cpu_seconds(), time.perf_counter()
        time.sleep(window)
        load = (busy_cpu_seconds() - before) / (time.perf_counter() - t)
        if load <= threshold or time.monotonic() >= deadline:
            return load


def parse_config(config: str) -> tuple[str, int | None, bool]:
    """``POLICY[@THREADS][+adaptive]`` -> (policy, threads or None for every core, adaptive threads)."""
    config, plus, adaptive = config.partition("+")
    if plus and adaptive != "adaptive":
        raise ValueError(f"{config}+{adaptive}: the only suffix is +adaptive")
    policy, _, threads = config.partition("@")
    return policy, int(threads) if threads else None, bool(plus)


def child(a: argparse.Namespace) -> None:
    """One configuration: apply its wait policy, then import torch, build the engine and time steps."""
    policy, threads, adaptive = parse_config(a.child)
    from hybridserve.kernels import threads as cpu_threads

    if policy.startswith("spins="):
        for name in cpu_threads.WAIT_VARIABLES:
            os.environ.pop(name, None)
        os.environ["GOMP_SPINCOUNT"] = policy.removeprefix("spins=")
        applied = cpu_threads.wait_policy_in_force("openmp")
    else:
        applied = cpu_threads.apply_wait_policy(policy)

    import torch

    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.sampling_params import SamplingParams

    steps_needed = 8 + 2 * a.phases * a.steps
    engine = LLMEngine(EngineConfig(model=a.model, dtype=a.dtype, cache_memory="2GiB", max_num_seqs=a.requests,
                                    max_model_len=a.prompt_len + steps_needed + 16, enable_progress_bar=False,
                                    cpu_threads=threads, cpu_wait_policy="auto", cpu_adaptive_threads=adaptive))
    vocab = engine.hf_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps_needed, ignore_eos=True)
    for i in range(a.requests):
        engine.add_request(str(i), torch.randint(3, vocab, (a.prompt_len,), generator=gen).tolist(), params)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # until every request decodes
    for _ in range(4):
        engine.step()

    others = {"quiet": [], "busy": []}  # cores' worth of CPU time the rest of the machine took in each phase
    counts = {"quiet": [], "busy": []}  # the thread count each step ran with (it changes with +adaptive)

    def timed(n: int, phase: str, neighbours: tuple[int, ...] = ()) -> list[float]:
        out = []
        start = (time.perf_counter(), busy_cpu_seconds(), process_cpu_seconds(os.getpid()),
                 sum(process_cpu_seconds(pid) for pid in neighbours))
        for _ in range(n):
            t = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - t)
            counts[phase].append(torch.get_num_threads())
        end = (time.perf_counter(), busy_cpu_seconds(), process_cpu_seconds(os.getpid()),
               sum(process_cpu_seconds(pid) for pid in neighbours))
        rest = (end[1] - start[1]) - (end[2] - start[2]) - (end[3] - start[3])
        others[phase].append(max(0.0, rest) / (end[0] - start[0]))
        return out

    quiet, busy = [], []
    for _ in range(a.phases):
        quiet += timed(a.steps, "quiet")
        neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR.format(seconds=a.neighbour_seconds)])
                      for _ in range(a.neighbours)]
        try:
            time.sleep(0.2)  # let them start spinning
            busy += timed(a.steps, "busy", tuple(p.pid for p in neighbours))
        finally:
            for p in neighbours:
                p.kill()
                p.wait()
        time.sleep(0.2)
    print(json.dumps({"config": a.child, "threads": torch.get_num_threads(), "wait_policy": applied.in_force,
                      "spin_count": applied.spin_count, "quiet_ms": [t * 1e3 for t in quiet],
                      "busy_ms": [t * 1e3 for t in busy], "other_load": others,
                      "step_threads": counts}))


def run_child(a: argparse.Namespace, config: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--model", a.model, "--dtype", a.dtype,
           "--requests", str(a.requests), "--prompt-len", str(a.prompt_len), "--steps", str(a.steps),
           "--phases", str(a.phases), "--neighbour-seconds", str(a.neighbour_seconds),
           "--neighbours", str(a.neighbours)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", default="spin,openmp,bounded,passive,bounded@1",
                        help="comma-separated POLICY[@THREADS][+adaptive] (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every configuration (rotated order)")
    parser.add_argument("--requests", type=int, default=32, help="sequences decoding in every step")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per phase")
    parser.add_argument("--phases", type=int, default=2, help="quiet / busy phase pairs per process")
    parser.add_argument("--neighbours", type=int, default=1, help="busy processes beside the engine")
    parser.add_argument("--neighbour-seconds", type=float, default=120.0, help="the busy loop's bound")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-other-load", type=float, default=None,
                        help="rerun a configuration whose phases saw more outside load than this (cores)")
    parser.add_argument("--retries", type=int, default=3, help="reruns allowed per configuration and round")
    parser.add_argument("--quiet-wait", type=float, default=300.0,
                        help="with --max-other-load: seconds to wait for a quiet machine before each run")
    parser.add_argument("--json", default=None, help="write every step time here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child is not None:
        child(a)
        return

    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    from hybridserve.kernels import isa
    from hybridserve.kernels.threads import usable_cores

    print(f"CPU: {isa.cpu_info().model}, {usable_cores()} cores usable; {a.requests} sequences x {a.prompt_len}-token "
          f"prompts, {a.dtype}; {a.rounds} rounds x {a.phases} x {a.steps} steps quiet / beside {a.neighbours} busy "
          "process(es) per configuration")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(a.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            for attempt in range(a.retries + 1):
                if a.max_other_load is not None:
                    wait_for_quiet(a.max_other_load, a.quiet_wait)
                result = run_child(a, config)
                load = max(max(v) for v in result["other_load"].values())
                if a.max_other_load is None or load <= a.max_other_load or attempt == a.retries:
                    break
                print(f"  round {r + 1} {config:14s} rerun: {load:.2f} cores of outside load", flush=True)
            runs[config].append(result)
            load = result["other_load"]
            print(f"  round {r + 1} {config:14s} quiet {statistics.median(result['quiet_ms']):7.1f} ms  "
                  f"busy {statistics.median(result['busy_ms']):7.1f} ms  (other load {max(load['quiet']):.2f} / "
                  f"{max(load['busy']):.2f} cores)", flush=True)
    print(f"\n{'config':14s} {'threads':>7s} {'spins':>12s} {'quiet ms':>20s} {'busy ms':>20s} {'busy/quiet':>10s}")
    for config, results in runs.items():
        q = [statistics.median(x["quiet_ms"]) for x in results]
        b = [statistics.median(x["busy_ms"]) for x in results]
        mq, mb = statistics.median(q), statistics.median(b)
        print(f"{config:14s} {results[0]['threads']:7d} {results[0]['spin_count']:12d} "
              f"{f'{mq:.1f} ({min(q):.0f}-{max(q):.0f})':>20s} {f'{mb:.1f} ({min(b):.0f}-{max(b):.0f})':>20s} "
              f"{mb / mq:10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"configs": configs, "runs": runs}, f)


if __name__ == "__main__":
    main()
