"""8-bit weights against bf16 on one checkpoint, and llama.cpp's Q8_0 and bf16 GGUFs of it, interleaved.

One process holds a bf16 engine and an int8 engine (``quantization="int8"``) of the same checkpoint and
runs, round after round: one stream (1 x PROMPT -> OUTPUT: its decode rate, prefill excluded) on each,
then, with ``--llama-cpp``, ``llama-bench -p 0 -n OUTPUT`` on each GGUF, then the batched workload
(REQUESTS x PROMPT -> OUTPUT, generated tok/s) on each engine, the engines' order swapped every other
round. Every round samples the same stretch of this machine's drifting speed, so the per-round ratios
(and their medians) are what to quote.

    python benchmarks/int8_decode.py --model /tmp/bench-mamba2-100m --rounds 5 \\
        --llama-cpp /work/llama.cpp/build --gguf-q8 /tmp/bench-mamba2-100m/model-q8_0.gguf \\
        --gguf-bf16 /tmp/bench-mamba2-100m/model-bf16.gguf
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


def _engine(model: str, quantization: str, max_seqs: int, max_len: int, cpu_isa: str):
    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantization=quantization, cache_memory="2GiB",
                                  max_num_seqs=max_seqs, max_model_len=max_len, enable_progress_bar=False,
                                  cpu_isa=cpu_isa))


def _generate(engine, prompts: list[list[int]], output: int) -> tuple[float, float]:
    """(seconds, median time to first token) of greedy generation of ``output`` tokens per prompt."""
    from hybridserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", p, params)
    first = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
    return time.perf_counter() - start, statistics.median(first.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", default=None, help="llama.cpp build folder (llama-bench)")
    parser.add_argument("--gguf-q8", default=None)
    parser.add_argument("--gguf-bf16", default=None)
    parser.add_argument("--json", default=None, help="write every round's figures here")
    parser.add_argument("--cpu-isa", default="auto", help="cap the ISA (auto, generic, avx2, avx512, avx512_bf16)")
    a = parser.parse_args()

    from hybridserve.kernels import isa

    isa.cap_torch(a.cpu_isa)  # before torch dispatches anything: ATen reads its cap once

    import torch

    torch.set_num_threads(a.threads)
    engines = {q: _engine(a.model, q, a.requests, a.prompt + a.output + 8, a.cpu_isa) for q in ("none", "int8")}
    vocab = engines["none"].hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (a.prompt,), generator=g).tolist() for _ in range(a.requests)]
    for engine in engines.values():  # warm-up: the whole batched workload, so its pool pages are touched before
        _generate(engine, prompts, a.output)  # the first timed round
    rounds = []
    for r in range(a.rounds):
        row = {}
        # every other round runs int8 first: the machine's drift within a round favours neither
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for q, engine in order:
            seconds, ttft = _generate(engine, prompts[:1], a.output)
            row[f"one_stream_decode_{q}"] = (a.output - 1) / (seconds - ttft)
        if a.llama_cpp:
            for label, gguf in (("q8_0", a.gguf_q8), ("bf16", a.gguf_bf16)):
                if gguf:
                    row[f"llama_cpp_decode_{label}"] = llama_cpp_runner.decode_rate(a.llama_cpp, gguf, a.output,
                                                                                     a.threads)
        for q, engine in order:
            seconds, _ = _generate(engine, prompts, a.output)
            row[f"batched_{q}"] = a.requests * a.output / seconds
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rounds)

    def ratio(num: str, den: str) -> float:
        return statistics.median(row[num] / row[den] for row in rounds)

    print(f"\nmedians over {a.rounds} rounds (tok/s): " + ", ".join(f"{k} {med(k):.1f}" for k in rounds[0]))
    print(f"one stream decode, int8 / bf16: {ratio('one_stream_decode_int8', 'one_stream_decode_none'):.2f} "
          "(median of per-round ratios)")
    if "llama_cpp_decode_q8_0" in rounds[0]:
        vs_q8 = ratio("one_stream_decode_int8", "llama_cpp_decode_q8_0")
        print(f"one stream decode, int8 / llama.cpp Q8_0: {vs_q8:.2f}")
    print(f"batched {a.requests}x{a.prompt}->{a.output}, int8 / bf16: {ratio('batched_int8', 'batched_none'):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
