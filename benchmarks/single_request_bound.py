"""One request alone: decode time per token against the memory-bandwidth bound, measured together.

A decode step of one sequence must read every weight once, so ``weight bytes / read bandwidth`` is
its floor. This script measures both in one process, alternating so that the machine's drift hits
both alike: rounds of (decode: median step time over a run of steady-state steps; read bandwidth:
median rate of 20 streaming reads of 256 MB by every thread (``csrc/probe.cpp``), just before and
just after the decode run, averaged),
then reports each round's ratio and the median.

    python benchmarks/single_request_bound.py --model /tmp/bench-granite-100m --prompt-len 512
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false")
    a = parser.parse_args()
    import torch

    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.sampling_params import SamplingParams

    torch.set_num_threads(a.threads)
    total_steps = a.rounds * (a.steps + 2) + 8
    engine = LLMEngine(EngineConfig(model=a.model, cache_memory="1GiB", max_num_seqs=1,
                                    max_model_len=a.prompt_len + total_steps + 8, enable_progress_bar=False,
                                    cpu_kernels=a.cpu_kernels))
    # bytes a decode step reads from the weights: every parameter and packed weight once, except an
    # embedding table (one row is looked up) unless it is also the LM head's weight
    def key(t: torch.Tensor) -> int:
        try:
            return t.data_ptr()
        except RuntimeError:  # an opaque (oneDNN-packed) tensor
            return id(t)

    embeddings = {key(m.weight) for m in engine.model.modules() if isinstance(m, torch.nn.Embedding)}
    head_weights = {key(m.weight) for m in engine.model.modules() if isinstance(m, torch.nn.Linear)}
    seen, weight_bytes = set(), 0
    for t in [*engine.model.parameters(), *engine.model.buffers()]:
        ptr = key(t)
        if ptr in seen or not t.is_floating_point() or (ptr in embeddings and ptr not in head_weights):
            continue
        seen.add(ptr)
        weight_bytes += t.numel() * t.element_size()
    vocab = engine.hf_config.vocab_size
    prompt = torch.randint(3, vocab, (a.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=total_steps, ignore_eos=True))
    for _ in range(4):
        engine.step()  # prefill and the first decode steps

    import ctypes

    from hybridserve.kernels.build import load_library

    probe = load_library("probe")
    if probe is None:
        raise SystemExit("the memory probe (csrc/probe.cpp) could not be built: a C++ compiler is needed")
    probe.hs_stream_read.restype = ctypes.c_uint64
    probe.hs_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    big = torch.ones(2 ** 28, dtype=torch.uint8)  # 256 MB, well past the caches

    def read_bandwidth() -> float:
        """Median rate of 20 full streaming reads of ``big`` by every thread (bytes/s)."""
        times = []
        for _ in range(20):
            t = time.perf_counter()
            probe.hs_stream_read(big.data_ptr(), big.numel())
            times.append(time.perf_counter() - t)
        return big.numel() / statistics.median(times)

    ratios = []
    print(f"weights read per decode step: {weight_bytes / 1e6:.1f} MB")
    for r in range(a.rounds):
        before = read_bandwidth()
        steps = []
        for _ in range(a.steps):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        bandwidth = (before + read_bandwidth()) / 2  # around the decode run
        step = statistics.median(steps)
        floor = weight_bytes / bandwidth
        ratios.append(step / floor)
        print(f"round {r + 1}: read bandwidth {bandwidth / 1e9:.1f} GB/s -> floor {floor * 1e3:.2f} ms; "
              f"decode step (median of {a.steps}) {step * 1e3:.2f} ms; ratio {step / floor:.2f}")
    print(f"median ratio over {a.rounds} rounds: {statistics.median(ratios):.2f} (target: at most 1.3)")


if __name__ == "__main__":
    main()
