"""Perplexity of one checkpoint's GGUF files in llama.cpp and in hybridserve, on the same tokens of a text.

llama.cpp's figures come from its own ``llama-perplexity``: the text is tokenized by the file's vocab, cut into
``--chunks`` chunks of ``--ctx`` tokens, each chunk run from an empty state, and the perplexity taken over the
second half of each chunk (positions ctx/2+1 .. ctx-1, each predicted from the chunk's earlier tokens). The BF16
file's run saves its log-probabilities (``--kl-divergence-base``) and the quantized files' runs give llama.cpp's
KL divergence from it and how often the two agree on the top token.

hybridserve runs the same chunks (the ids of ``llama-tokenize``, the first token of a chunk replaced by BOS where
the vocab adds one, as llama-perplexity does) as prompts with ``prompt_logprobs`` and scores the same positions:
the perplexity, and the mean |Δlogprob| of the text's tokens against its bf16 run of the safetensors checkpoint.
A hybridserve run is ``bf16`` (the safetensors checkpoint in bf16), ``gguf:NAME`` (the file model-NAME.gguf, with
``dtype=auto``) or a ``--quantization`` value of the safetensors checkpoint (``int8``, ``int4``, ...), each
optionally ``/N`` (the prompts prefilled N tokens a step, so that the linears take few-row calls, as in decode)
and ``@LEVEL`` (run with ``--cpu-isa LEVEL``), in that order: ``gguf:q6_k/8@avx512``.

    nice -n 19 python benchmarks/gguf_perplexity.py --model /root/bench/granite-1.3b \\
        --text /root/.pyenv/versions/3.11.7/lib/python3.11/LICENSE.txt --llama-cpp /root/peers/llama.cpp/build \\
        --ctx 512 --chunks 4 --json /root/bench/s5/perplexity-1.3b.json

The folder holds model-bf16.gguf (benchmarks/make_gguf.py) and model-q8_0.gguf / model-q4_k_m.gguf
(``llama-quantize model-bf16.gguf model-q8_0.gguf Q8_0``). Run it with the project on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_runner

LLAMA_FILES = ("bf16", "q8_0", "q4_k_m")
DEFAULT_RUNS = ["bf16", "gguf:q8_0", "gguf:q4_k_m", "int8", "int4", "gguf:bf16"]
# llama-perplexity's summary lines: (key, pattern)
LLAMA_FIGURES = {
    "ppl": r"Final estimate: PPL = ([0-9.eE+-]+|inf|nan)",
    "ppl_q": r"Mean PPL\(Q\)\s*:\s*([0-9.eE+-]+|inf|nan)",
    "kld": r"Mean\s+KLD:\s*([0-9.eE+-]+|inf|nan)",
    "same_top_p_pct": r"Same top p:\s*([0-9.eE+-]+)",
}


def tool(build: str, name: str) -> str:
    """The path of llama.cpp's ``name`` in ``build`` (its build folder or its bin/)."""
    path = llama_cpp_runner.tool(build, name)
    if path is not None:
        return path
    raise FileNotFoundError(f"{name} not found in {build} or {build}/bin (--llama-cpp: llama.cpp's build folder; "
                            f"build it with `cmake --build BUILD --target {name}`)")


def llama_tokens(build: str, gguf: str, text: str) -> tuple[list[int], bool]:
    """(the text's ids as llama-perplexity gets them, whether the vocab adds BOS), from llama-tokenize."""

    def ids(*extra: str) -> list[int]:
        out = subprocess.run([tool(build, "llama-tokenize"), "-m", gguf, "-f", text, "--ids", "--log-disable",
                              *extra], capture_output=True, text=True, check=True).stdout
        return ast.literal_eval(out.strip().splitlines()[-1])

    with_special, plain = ids(), ids("--no-bos")
    return with_special, with_special != plain


def chunk_prompts(ids: list[int], ctx: int, chunks: int, bos: int | None) -> list[list[int]]:
    """The ``chunks`` prompts llama-perplexity evaluates: consecutive ``ctx``-token slices of ``ids``, the first
    token of each replaced by ``bos`` when the vocab adds one."""
    if len(ids) < ctx * chunks:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --chunks {chunks} x --ctx {ctx}")
    prompts = [ids[i * ctx:(i + 1) * ctx] for i in range(chunks)]
    return [[bos, *p[1:]] if bos is not None else p for p in prompts]


def scored_positions(ctx: int) -> range:
    """The positions of a chunk whose token llama-perplexity scores: its second half but the first token."""
    return range(ctx // 2 + 1, ctx)


def parse_llama_perplexity(output: str) -> dict[str, float]:
    """The figures of a llama-perplexity run's output (those it printed)."""
    figures = {}
    for key, pattern in LLAMA_FIGURES.items():
        match = re.search(pattern, output)
        if match:
            figures[key] = float(match.group(1))
    return figures


def run_llama_perplexity(build: str, gguf: str, text: str, ctx: int, chunks: int, threads: int,
                         base: str, as_base: bool, attempts: int = 3) -> dict[str, float]:
    """One llama-perplexity run: the BF16 file writes its log-probabilities to ``base``, the others are compared
    with them (KL divergence, same top token). llama.cpp's logger sometimes loses its last lines when the process
    exits (seen on a loaded machine): a run whose summary is missing is repeated, up to ``attempts`` times."""
    cmd = [tool(build, "llama-perplexity"), "-m", gguf, "-f", text, "-c", str(ctx), "--chunks", str(chunks),
           "-t", str(threads), "--kl-divergence-base", base, *([] if as_base else ["--kl-divergence"])]
    wanted = {"ppl"} if as_base else {"ppl_q", "kld", "same_top_p_pct"}
    for attempt in range(attempts):
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-perplexity failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        figures = parse_llama_perplexity(proc.stdout + proc.stderr)
        if wanted <= figures.keys():
            break
        print(f"llama-perplexity printed no {sorted(wanted - figures.keys())} for {gguf} (attempt {attempt + 1} "
              f"of {attempts})", file=sys.stderr, flush=True)
    if "ppl_q" in figures:  # a --kl-divergence run states the file's own perplexity as PPL(Q)
        figures["ppl"] = figures.pop("ppl_q")
    return {**figures, "seconds": time.perf_counter() - t}


def hybridserve_logprobs(path: str, prompts: list[list[int]], threads: int, **options) -> list[float]:
    """The logprob hybridserve gives each scored token of ``prompts`` (chunk by chunk, in order)."""
    from hybridserve import LLM, SamplingParams

    ctx = len(prompts[0])
    llm = LLM(path, cache_memory="1GiB", max_num_seqs=2, max_model_len=ctx + 8, cpu_threads=threads,
              enable_progress_bar=False, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    del llm
    gc.collect()
    return [out.prompt_logprobs[i][prompt[i]].logprob for out, prompt in zip(outs, prompts)
            for i in scored_positions(ctx)]


def save(results: dict, path: str | None) -> None:
    """Write the figures so far to ``path`` (after every run: a long run stopped early keeps what it measured)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def run_options(run: str, model: str) -> tuple[str, dict]:
    """(the path hybridserve loads, its options) for a run name of --runs; ``RUN@LEVEL`` runs RUN with the kernels
    capped at ISA level LEVEL (``--cpu-isa``: ``gguf:q6_k@avx512`` keeps the activations of the few-row calls
    unrounded, where avx512_bf16 and amx quantize them to int8)."""
    if "@" in run:
        run, level = run.split("@", 1)
        path, options = run_options(run, model)
        return path, {**options, "cpu_isa": level}
    if "/" in run:  # RUN/N: prefill in steps of N tokens (as decode steps: the kernels' few-row paths)
        run, tokens = run.split("/", 1)
        path, options = run_options(run, model)
        return path, {**options, "max_num_batched_tokens": int(tokens)}
    if run == "bf16":
        return model, {"dtype": "bfloat16"}
    if run.startswith("gguf:"):
        return os.path.join(model, f"model-{run[len('gguf:'):]}.gguf"), {"dtype": "auto"}
    return model, {"dtype": "bfloat16", "quantization": run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="safetensors checkpoint folder holding the model-*.gguf files")
    parser.add_argument("--text", required=True, help="the text file (plain English, a few thousand tokens)")
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP", "/work/llama.cpp/build"),
                        help="llama.cpp build folder with llama-perplexity and llama-tokenize")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks (llama-perplexity --chunks)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", nargs="*", default=DEFAULT_RUNS, help="hybridserve runs (see above)")
    parser.add_argument("--llama-files", nargs="*", default=list(LLAMA_FILES),
                        help="model-NAME.gguf files for llama-perplexity, the BF16 one first")
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    bf16_gguf = os.path.join(a.model, "model-bf16.gguf")
    ids, adds_bos = llama_tokens(a.llama_cpp, bf16_gguf, a.text)
    bos = ids[0] if adds_bos else None
    prompts = chunk_prompts(ids, a.ctx, a.chunks, bos)
    scored = a.chunks * len(scored_positions(a.ctx))
    print(f"{a.text}: {len(ids)} tokens; {a.chunks} chunks of {a.ctx}, {scored} tokens scored; BOS {adds_bos}",
          flush=True)
    results: dict = {"text": a.text, "tokens": len(ids), "ctx": a.ctx, "chunks": a.chunks, "scored": scored,
                     "llama.cpp": {}, "hybridserve": {}}
    with tempfile.TemporaryDirectory(prefix="gguf_perplexity-") as tmp:
        base = os.path.join(tmp, "bf16.kld")
        for i, name in enumerate(a.llama_files):
            r = run_llama_perplexity(a.llama_cpp, os.path.join(a.model, f"model-{name}.gguf"), a.text, a.ctx,
                                     a.chunks, a.threads, base, as_base=i == 0)
            results["llama.cpp"][name] = r
            print(f"llama.cpp {name}: {r}", flush=True)
            save(results, a.json)
    reference = None
    for run in a.runs:
        path, options = run_options(run, a.model)
        t = time.perf_counter()
        logprobs = hybridserve_logprobs(path, prompts, a.threads, **options)
        r = {"ppl": math.exp(-statistics.fmean(logprobs)), "seconds": time.perf_counter() - t}
        if run == "bf16":
            reference = logprobs
        if reference is not None:
            r["mean_abs_dlogprob"] = statistics.fmean(abs(x - y) for x, y in zip(logprobs, reference))
        results["hybridserve"][run] = r
        print(f"hybridserve {run}: {r}", flush=True)
        save(results, a.json)


if __name__ == "__main__":
    main()
