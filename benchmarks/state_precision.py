"""How far each recurrent-state dtype drifts from float32 state: mean |Δlogprob| over a long teacher-forced text.

For one checkpoint (the shipped default model, or a tiny checkpoint per family from ``tests/checkpoints.py``),
a text of ``--prompt`` random tokens plus ``--generated`` tokens that a float32-state run generates greedily
from them is fed to the engine ONE TOKEN PER STEP (``max_num_batched_tokens=1``), so every token's update
rounds the stored state, as decoding does. At every position the logprob of the text's next token is taken
(prompt logprobs); the figure of a variant is the mean and max |Δlogprob| against the float32-state run,
over all positions and over the generated half. Variants: ``bfloat16`` state (torch's round-to-nearest-even),
``int8`` and ``fp8_e4m3`` with the engine's seeded stochastic rounding, and the same two with round-to-nearest
(``encode_rows`` with ``noise=None``, patched in for the measurement only). Plain PyTorch bodies
(``cpu_kernels=False``) for all.

    python benchmarks/state_precision.py --default-model
    python benchmarks/state_precision.py --family bamba mamba qwen3_next --json /tmp/drift.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from contextlib import contextmanager

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache import state_codec

TEMPORAL_FAMILIES = ["bamba", "mamba2", "mamba", "falcon_mamba", "jamba", "granitemoehybrid", "nemotron_h", "zamba2",
                     "falcon_h1", "minimax", "qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "xlstm"]
VARIANTS = [("bfloat16", "nearest"), ("int8", "stochastic"), ("int8", "nearest"), ("fp8_e4m3", "stochastic"),
            ("fp8_e4m3", "nearest")]


@contextmanager
def round_to_nearest():
    """CodedState.write with round-to-nearest codes instead of the seeded stochastic rounding."""
    original = state_codec.CodedState.write

    def write(self, idx, values, keys, positions):
        codes, scale = state_codec.encode_rows(values, self.codes.dtype, None)
        self.codes.view(torch.uint8).index_copy_(0, idx, codes.view(torch.uint8))
        self.scale.index_copy_(0, idx, scale)

    state_codec.CodedState.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        state_codec.CodedState.write = original  # type: ignore[method-assign]


def _engine(path: str, state_dtype: str, **extra) -> LLM:
    return LLM(path, mamba_ssm_cache_dtype=state_dtype, cpu_kernels=False, cache_memory="256MiB",
               max_model_len=2048, enable_prefix_caching=False, enable_progress_bar=False, **extra)


def _text(path: str, vocab: int, prompt_len: int, generated: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
    llm = _engine(path, "float32")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=generated,
                                                                     ignore_eos=True))[0]
    return prompt + list(out.outputs[0].token_ids)


def _logprobs(path: str, text: list[int], state_dtype: str, rounding: str) -> list[float]:
    """The logprob of each next token of ``text`` (positions 1..len-1), fed one token per step."""
    with (round_to_nearest() if rounding == "nearest" else _nothing()):
        llm = _engine(path, state_dtype, max_num_batched_tokens=1)
        out = llm.generate([{"prompt_token_ids": text}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], text[1:])]


@contextmanager
def _nothing():
    yield


def measure(path: str, label: str, prompt_len: int, generated: int) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    text = _text(path, vocab, prompt_len, generated)
    start = time.perf_counter()
    ref = _logprobs(path, text, "float32", "stochastic")
    result = {"model": label, "positions": len(ref), "variants": {}}
    for state_dtype, rounding in VARIANTS:
        lps = _logprobs(path, text, state_dtype, rounding)
        diffs = [abs(a - b) for a, b in zip(lps, ref)]
        tail = diffs[prompt_len - 1:]  # positions predicting the generated half
        result["variants"][f"{state_dtype}/{rounding}"] = {
            "mean": sum(diffs) / len(diffs), "max": max(diffs), "mean_generated": sum(tail) / max(len(tail), 1)}
    result["seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--default-model", action="store_true", help="measure hybridserve/default_model")
    parser.add_argument("--family", nargs="*", default=[], help="tiny checkpoints of tests/checkpoints.py "
                        "(all temporal-state families with 'all')")
    parser.add_argument("--prompt", type=int, default=520)
    parser.add_argument("--generated", type=int, default=520)
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models: list[tuple[str, str]] = []
    if args.default_model:
        from hybridserve.default_model import default_model_path

        models.append((default_model_path(), "default_model"))
    families = TEMPORAL_FAMILIES if args.family == ["all"] else args.family
    if families:
        from tests.checkpoints import make

        tmp = tempfile.mkdtemp()
        models += [(make(tmp, family), family) for family in families]
    print(f"CPU: {platform.processor() or platform.machine()}; {args.prompt} + {args.generated} tokens, one per step")
    results = []
    for path, label in models:
        r = measure(path, label, args.prompt, args.generated)
        results.append(r)
        cells = "  ".join(f"{k} {v['mean']:.2e}" for k, v in r["variants"].items())
        print(f"{label:18s} {cells}  ({r['seconds']:.0f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
