"""4-bit weights against int8 and bf16 on one checkpoint, interleaved: one-stream decode and one prefill.

One process holds a bf16 engine, an int8 engine and one int4 engine per ``--groups`` entry of the same checkpoint,
and runs, round after round, on each engine: one stream (1 x PROMPT -> OUTPUT: its decode rate, prefill excluded)
and one prefill (1 x PREFILL -> 1 token: its time to the first token), the engines' order reversed every other
round. Every round samples the same stretch of a shared machine's drifting speed, so the medians of the per-round
ratios are what to quote.

    python benchmarks/int4_decode.py --model /tmp/bench-granite-1.3b --rounds 5
    python benchmarks/int4_decode.py --model DIR --cpu-isa avx2   # the kernel paths of a CPU of that class

``--gguf FILE`` adds an engine that loads that GGUF file (a ``llama-quantize`` output of the same checkpoint, its
quantized weights as they are), and ``--llama-cpp BUILD`` then runs ``llama-bench -p 0 -n OUTPUT`` on the same file
right after the engines' one-stream runs of each round, so that llama.cpp's decode and the file's decode in
hybridserve sample the same minutes of a shared machine:

    python benchmarks/int4_decode.py --model DIR --gguf DIR/model-q4_k_m.gguf --llama-cpp LLAMA_BUILD --rounds 7

``--interleave-steps`` runs each round's one-stream requests on all engines at once, one engine step at a time
in turn (``interleaved_steps.py``), so that every engine's decode samples the same seconds; a round's rate is its
decode steps over their summed time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_runner
from interleaved_steps import interleaved_steps


def _engine(model: str, quantization: str, group: int | None, max_len: int, cpu_isa: str):
    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantization=quantization,
                                  quantization_group_size=group, cache_memory="1GiB", max_num_seqs=2, cpu_isa=cpu_isa,
                                  max_model_len=max_len, enable_progress_bar=False,
                                  enable_prefix_caching=False))  # each round's prefill computed, not a cache hit


def _generate(engine, prompt: list[int], output: int) -> tuple[float, float]:
    """(seconds, time to the first token) of one greedy request of ``output`` tokens."""
    from hybridserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter() - start
    return time.perf_counter() - start, first if first is not None else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--groups", default="32", help="int4 group sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write every round's figures here")
    parser.add_argument("--cpu-isa", default="auto", help="cap the ISA (auto, generic, avx2, avx512, avx512_bf16)")
    parser.add_argument("--gguf", default=None, help="also run an engine that loads this GGUF file")
    parser.add_argument("--llama-cpp", default=None, help="llama.cpp build folder: llama-bench on the --gguf file")
    parser.add_argument("--interleave-steps", action="store_true",
                        help="time the one-stream decodes with the engines' steps alternated one by one "
                             "(interleaved_steps.py) instead of one whole request after another")
    a = parser.parse_args()
    if a.llama_cpp and not a.gguf:
        parser.error("--llama-cpp times llama.cpp on the --gguf file: give --gguf FILE")

    from hybridserve.kernels import isa

    isa.cap_torch(a.cpu_isa)  # before torch dispatches anything: ATen reads its cap once

    import torch

    torch.set_num_threads(a.threads)
    max_len = max(a.prompt + a.output, a.prefill + 1) + 8
    specs = {"bf16": ("none", None), "int8": ("int8", None),
             **{f"int4_g{g}": ("int4", int(g)) for g in a.groups.split(",")}}
    engines = {name: _engine(a.model, q, g, max_len, a.cpu_isa) for name, (q, g) in specs.items()}
    if a.gguf:
        engines["gguf"] = _engine(a.gguf, "auto", None, max_len, a.cpu_isa)
    vocab = engines["bf16"].hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (a.prompt,), generator=g).tolist()
    long_prompt = torch.randint(3, vocab, (a.prefill,), generator=g).tolist()
    for engine in engines.values():  # warm-up
        _generate(engine, prompt, 4)
        _generate(engine, long_prompt, 1)
    rounds = []
    for r in range(a.rounds):
        row = {}
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        if a.interleave_steps:
            from hybridserve.sampling_params import SamplingParams

            params = SamplingParams(temperature=0, max_tokens=a.output, ignore_eos=True, detokenize=False)
            steps = interleaved_steps(dict(order), [prompt], params, f"r{r}")
            for name, times in steps.items():  # the first step is the prompt's prefill
                row[f"decode_{name}"] = (len(times) - 1) / sum(times[1:])
        else:
            for name, engine in order:
                seconds, ttft = _generate(engine, prompt, a.output)
                row[f"decode_{name}"] = (a.output - 1) / (seconds - ttft)
        if a.llama_cpp:
            row["decode_llama_cpp"] = llama_cpp_runner.decode_rate(a.llama_cpp, a.gguf, a.output, a.threads)
        for name, engine in order:
            row[f"prefill_{name}"] = a.prefill / _generate(engine, long_prompt, 1)[1]
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)

    def ratio(num: str, den: str) -> float:
        return statistics.median(row[num] / row[den] for row in rounds)

    print(f"\nCPU: {isa.cpu_info().model}, ISA {isa.level_in_force()}, {a.threads} threads; medians over "
          f"{a.rounds} rounds (tok/s): " + ", ".join(f"{k} {statistics.median(r[k] for r in rounds):.1f}"
                                                   for k in rounds[0]))
    for name in specs:
        if name.startswith("int4"):
            print(f"{name}: decode / int8 {ratio(f'decode_{name}', 'decode_int8'):.2f}, decode / bf16 "
                  f"{ratio(f'decode_{name}', 'decode_bf16'):.2f}, prefill / bf16 "
                  f"{ratio(f'prefill_{name}', 'prefill_bf16'):.2f} (medians of per-round ratios)")
    if a.llama_cpp:
        print(f"gguf: decode / llama.cpp on the same file {ratio('decode_gguf', 'decode_llama_cpp'):.2f} (median of "
              f"per-round ratios)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cpu": isa.cpu_info().model, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
