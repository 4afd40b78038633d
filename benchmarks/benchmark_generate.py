"""Throughput benchmark: N requests of given prompt/output lengths, hybridserve vs HF transformers.

Each engine runs in its own subprocess (so peak memory is its own), one after the other, on the same
checkpoint and the same random prompts; greedy decoding, EOS ignored. Prints generated tokens/s,
time to first token and peak RSS for each, and the hybridserve / HF ratio.

    python benchmarks/benchmark_generate.py --model DIR --num-requests 8 --prompt-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time

from hybridserve.config import QUANTIZATIONS


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_hybridserve(args: dict, prompts: list[list[int]], queue: mp.Queue) -> None:
    from hybridserve.kernels import isa

    isa.cap_torch(args.get("cpu_isa", "auto"))  # before torch dispatches anything (a spawned process)
    import torch

    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.sampling_params import SamplingParams

    torch.set_num_threads(args["threads"])
    engine = LLMEngine(EngineConfig(model=args["model"], dtype=args["dtype"], cpu_isa=args.get("cpu_isa", "auto"),
                                    mamba_ssm_cache_dtype=args["mamba_ssm_cache_dtype"],
                                    quantization=args.get("quantization", "auto"),
                                    cache_memory=args["cache_memory"], max_num_seqs=max(len(prompts), 1),
                                    max_num_batched_tokens=args["max_num_batched_tokens"],
                                    max_model_len=max(len(p) for p in prompts) + args["output_len"],
                                    enable_progress_bar=False, speculative_config=args.get("speculative_config")))
    # token ids only, as the vLLM runner asks of vLLM (detokenize=False): the same work for both
    params = SamplingParams(temperature=0, max_tokens=args["output_len"], ignore_eos=True, detokenize=False)
    # warm-up
    engine.add_request("warm", prompts[0][:8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            tokens[out.request_id] = out.outputs[0].token_ids
    elapsed = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    queue.put({"engine": "hybridserve", "seconds": elapsed, "generated_tokens": generated,
               "tokens_per_s": generated / elapsed, "ttft_median_s": statistics.median(first.values()),
               "peak_rss_mib": _peak_rss_mib(), "spec_decode": engine.spec_decode_stats(),
               "tokens": [tokens[str(i)] for i in range(len(prompts))]})


def run_hf(args: dict, prompts: list[list[int]], queue: mp.Queue) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args["threads"])
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}[args["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)
    pad = model.config.pad_token_id or 0
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=pad)
        ttft = time.perf_counter() - t0
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args["output_len"], do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
    generated = out[:, ids.shape[1]:]
    queue.put({"engine": "hf-transformers", "seconds": elapsed, "generated_tokens": generated.numel(),
               "tokens_per_s": generated.numel() / elapsed, "ttft_median_s": ttft,
               "peak_rss_mib": _peak_rss_mib(), "tokens": generated.tolist()})


def _in_subprocess(fn, args: dict, prompts: list[list[int]]) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=fn, args=(args, prompts, queue))
    proc.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except Exception:  # queue.Empty: keep waiting while the worker lives
            if not proc.is_alive():
                raise RuntimeError(f"{fn.__name__} failed (exit code {proc.exitcode})") from None
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS))
    parser.add_argument("--cache-memory", default="2GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--speculative-config", default=None,
                        help="hybridserve's speculative decoding, as JSON (its figures are printed too)")
    parser.add_argument("--json", default=None, help="write results to this file")
    a = parser.parse_args()
    if a.model is None:
        from hybridserve.default_model import default_model_path

        a.model = default_model_path()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    prompts = _prompts(a.num_requests, a.prompt_len, vocab, a.seed)
    args = vars(a)
    results = [_in_subprocess(run_hybridserve, args, prompts)]
    if not a.skip_hf:
        results.append(_in_subprocess(run_hf, args, prompts))
    print(f"{a.num_requests} requests x {a.prompt_len} prompt -> {a.output_len} generated tokens, "
          f"model {a.model}, dtype {a.dtype}, {a.threads} threads")
    print(f"{'engine':<18}{'gen tok/s':>12}{'TTFT med s':>12}{'total s':>10}{'peak RSS MiB':>14}")
    for r in results:
        print(f"{r['engine']:<18}{r['tokens_per_s']:>12.1f}{r['ttft_median_s']:>12.3f}{r['seconds']:>10.2f}"
              f"{r['peak_rss_mib']:>14.0f}")
        if a.num_requests == 1 and a.output_len > 1:  # one stream: its decode rate, prefill excluded
            print(f"{r['engine']} decode: {(a.output_len - 1) / (r['seconds'] - r['ttft_median_s']):.1f} tok/s")
    if len(results) == 2:
        ratio = results[0]["tokens_per_s"] / results[1]["tokens_per_s"]
        same = sum(x == y for x, y in zip(results[0]["tokens"], results[1]["tokens"]))
        print(f"hybridserve / HF generated tok/s: {ratio:.2f}x; identical greedy outputs: {same}/{len(prompts)}")
    spec = results[0].get("spec_decode")
    if spec:
        print(f"speculative decoding: {spec['num_drafts']} verifications, {spec['num_accepted_tokens']}/"
              f"{spec['num_draft_tokens']} draft tokens accepted ({spec['acceptance_rate']:.1%}), mean acceptance "
              f"length {spec['mean_acceptance_length']:.2f}, verifications accepting 0, 1, ... drafts: "
              f"{spec['accepted_length_counts']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in results], f, indent=2)


if __name__ == "__main__":
    main()
