"""Where one engine step spends its time: linear layers, LM head, each CPU kernel, sampling, and the
rest (Python and small PyTorch ops), averaged over decode steps (or for the first prefill step).

    python benchmarks/profile_step.py --model /tmp/bench-granite-100m --requests 32 --prompt-len 128
    python benchmarks/profile_step.py --model DIR --prefill          # the first (prefill) step instead
    python benchmarks/profile_step.py --model DIR --no-cpu-kernels   # the plain-PyTorch paths
    python benchmarks/profile_step.py --model DIR --enforce-eager    # decode through the modules
    python benchmarks/profile_step.py --model DIR --mamba-ssm-cache-dtype int8  # 8-bit state

Each component is timed by wrapping its Python entry point with ``time.perf_counter``, so the
numbers add up to the step time; the wrappers cost a few microseconds per call. Decode steps replayed
from their capture (``engine/decode_capture.py``) are timed per kernel inside the replay instead, and
the last line gives the host time of a step: the step's wall time outside every compiled kernel call
(a replay counts as one), that is Python and the small PyTorch ops around the kernels.
"""

from __future__ import annotations

import argparse
import collections
import time

from hybridserve.config import QUANTIZATIONS


def entry_point(kernel: str) -> str:
    """The name of a replayed kernel's Python entry point (``hs_linear_bf16`` -> ``linear``)."""
    name = kernel.removeprefix("hs_")
    return "linear" if name.startswith("linear_") else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="decode steps to average over")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", action="store_true", help="time the first step (prefill) instead")
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false")
    parser.add_argument("--enforce-eager", action="store_true", help="no captured decode steps")
    parser.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS))
    parser.add_argument("--cpu-isa", default="auto", help="cap the ISA (auto, generic, avx2, avx512, avx512_bf16, amx)")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto",
                        help="the recurrent state dtype (int8, fp8_e4m3: the coded kernels, mamba2_scan_coded)")
    a = parser.parse_args()

    from hybridserve.kernels import isa

    isa.cap_torch(a.cpu_isa)  # before torch dispatches anything: ATen reads its cap once

    import torch

    import hybridserve.engine.output_processor as output_processor
    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.kernels import _abi, attention, pointwise, recurrent, recurrent_coded
    from hybridserve.layers import linear_w8, packed_linear
    from hybridserve.sampling_params import SamplingParams

    torch.set_num_threads(a.threads)
    engine = LLMEngine(EngineConfig(model=a.model, dtype=a.dtype, cache_memory="4GiB", max_num_seqs=a.requests,
                                    quantization=a.quantization,
                                    max_num_batched_tokens=2048, max_model_len=a.prompt_len + a.steps + 16,
                                    enable_progress_bar=False, cpu_kernels=a.cpu_kernels,
                                    enforce_eager=a.enforce_eager, cpu_isa=a.cpu_isa,
                                    mamba_ssm_cache_dtype=a.mamba_ssm_cache_dtype))
    vocab = engine.hf_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=a.steps + 8, ignore_eos=True)
    for i in range(a.requests):
        engine.add_request(str(i), torch.randint(3, vocab, (a.prompt_len,), generator=gen).tolist(), params)
    if not a.prefill:
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()  # until every request decodes
        for _ in range(3):
            engine.step()

    spent: collections.Counter[str] = collections.Counter()

    def timed(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(owner, name, wrapper)

    def time_linear(cls) -> None:
        forward = cls.forward

        def linear(self, x):
            t = time.perf_counter()
            try:
                return forward(self, x)
            finally:
                spent["lm_head" if self.out_features == vocab else "linear"] += time.perf_counter() - t
        cls.forward = linear
    time_linear(packed_linear.PackedLinear)
    time_linear(packed_linear.KernelLinear)
    time_linear(linear_w8.W8Linear)
    for module, names in ((recurrent, ("mamba2_scan", "causal_conv1d")), (attention, ("paged_attention", "kv_write")),
                          (pointwise, ("rms_norm", "gated_rms_norm", "silu_mul", "gather_rows", "rotary"))):
        for name in names:
            timed(module, name, name)
    timed(recurrent_coded, "mamba2_scan", "mamba2_scan_coded")  # the name a captured replay gives it
    timed(output_processor, "sample", "sampling")
    timed(engine.model, "forward", "model forward")
    timed(engine.runner, "run", "runner")
    captured = engine.runner.captured_decode
    if captured is not None:
        timed(captured, "run", "captured replay")
        for graph in captured.graphs.values():
            graph.start_profiling()

    in_kernels = [0.0]  # seconds inside compiled kernel calls (a replay is one)
    kernel_call = _abi.Kernel.__call__

    def timed_kernel(self, *args):
        t = time.perf_counter()
        try:
            return kernel_call(self, *args)
        finally:
            in_kernels[0] += time.perf_counter() - t
    _abi.Kernel.__call__ = timed_kernel

    steps = 1 if a.prefill else a.steps
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(finished_only=True)  # as LLM.generate steps
    total = (time.perf_counter() - start) / steps
    per = {k: v / steps for k, v in spent.items()}
    parts = {k: v for k, v in per.items() if k not in ("model forward", "runner", "captured replay")}
    model_inner = sum(v for k, v in parts.items() if k not in ("lm_head", "sampling"))
    parts["other in model forward"] = per.get("model forward", 0.0) - model_inner
    forward = per.get("model forward", 0.0) + per.get("captured replay", 0.0)
    in_replay: dict[str, float] = {}
    if captured is not None:  # its kernels, under the names of their Python entry points
        for graph in captured.graphs.values():
            for name, secs in graph.kernel_seconds().items():
                in_replay[entry_point(name)] = in_replay.get(entry_point(name), 0.0) + secs / steps
        for name, secs in in_replay.items():
            parts[name] = parts.get(name, 0.0) + secs
        parts["other in captured replay"] = per.get("captured replay", 0.0) - sum(in_replay.values())
    parts["other in runner"] = per.get("runner", 0.0) - forward - per.get("lm_head", 0.0)
    parts["other in engine step"] = total - per.get("runner", 0.0) - per.get("sampling", 0.0)
    kind = "prefill step" if a.prefill else f"decode step ({a.requests} sequences)"
    mode = "captured replay" if captured is not None and not a.prefill else "modules"
    print(f"{kind}: {total * 1e3:.1f} ms (cpu kernels {'on' if engine.cpu_kernels else 'off'}, {mode})")
    for name, secs in sorted(parts.items(), key=lambda kv: -kv[1]):
        if abs(secs) < 5e-6:
            continue  # a part this step does not have (the model's forward under a replay, say)
        print(f"  {name:<26}{secs * 1e3:8.2f} ms  {100 * secs / total:5.1f}%")
    print(f"host time per step (outside compiled kernel calls): {(total - in_kernels[0] / steps) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
