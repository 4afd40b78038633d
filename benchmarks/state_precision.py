"""How far each recurrent-state dtype drifts from float32 state: mean |Δlogprob| over a long teacher-forced text.

For one checkpoint (the shipped default model, or a tiny checkpoint per family from ``tests/checkpoints.py``),
a text of ``--prompt`` random tokens plus ``--generated`` tokens that a float32-state run generates greedily
from them is fed to the engine ONE TOKEN PER STEP (``max_num_batched_tokens=1``), so every token's update
rounds the stored state, as decoding does. At every position the logprob of the text's next token is taken
(prompt logprobs); the figure of a variant is the mean and max |Δlogprob| against the float32-state run,
over all positions and over the generated half. Plain PyTorch bodies (``cpu_kernels=False``) for all.

``--variants`` names what is measured, each ``<state dtype>/<rounding>``: ``bfloat16/nearest`` (or another
float dtype: torch's round-to-nearest-even), and for ``int8`` or ``fp8_e4m3`` a rounding scheme of
``state_rounding.py``, ``<base>[-weyl][-g<K>]``: ``stochastic`` (the engine's seeded stochastic rounding, run
unpatched, for every state kind: the engine itself rounds the delta rules and mLSTM to nearest), ``nearest``,
``subtractive`` (subtractive dither), ``-weyl`` (noise low-discrepancy in time), ``-g<K>`` (K 8-bit scales per
row). Everything but the engine's own ``stochastic`` is patched in for the measurement only.
The default is today's five: bfloat16/nearest, int8 and fp8_e4m3 each stochastic and nearest.
``--keys`` runs each 8-bit variant once per rounding key (the request seed its noise is keyed on) and averages
the figures over them (``mean_per_key`` in the JSON lists each); the default is key 0.

    python benchmarks/state_precision.py --default-model
    python benchmarks/state_precision.py --family bamba mamba qwen3_next --json /tmp/drift.json
    python benchmarks/state_precision.py --family mamba2 --variants bfloat16/nearest int8/stochastic \\
        int8/subtractive int8/subtractive-weyl int8/stochastic-g2 int8/subtractive-g2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import state_rounding  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.cache import spec  # noqa: E402
from hybridserve.cache.state_codec import CODE_DTYPES  # noqa: E402

TEMPORAL_FAMILIES = ["bamba", "mamba2", "mamba", "falcon_mamba", "jamba", "granitemoehybrid", "nemotron_h", "zamba2",
                     "falcon_h1", "minimax", "qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "xlstm"]
DEFAULT_VARIANTS = ["bfloat16/nearest", "int8/stochastic", "int8/nearest", "fp8_e4m3/stochastic",
                    "fp8_e4m3/nearest"]
FLOAT_STATE_DTYPES = ["bfloat16", "float16"]
#: the engine's own rounding (run unpatched)
ENGINE_ROUNDING = state_rounding.Rounding("stochastic")


def parse_variant(name: str) -> tuple[str, state_rounding.Rounding]:
    """``<state dtype>/<rounding>`` -> (state dtype, rounding); a ValueError naming the bad value and the
    allowed ones (the flag: ``--variants``)."""
    state_dtype, _, rounding = name.partition("/")
    if state_dtype in FLOAT_STATE_DTYPES:
        if rounding != "nearest":
            raise ValueError(f"--variants {name!r}: a float state dtype rounds to nearest only "
                             f"('{state_dtype}/nearest')")
        return state_dtype, state_rounding.Rounding("nearest")
    if state_dtype not in CODE_DTYPES:
        raise ValueError(f"--variants {name!r}: unknown state dtype {state_dtype!r}; allowed: "
                         f"{FLOAT_STATE_DTYPES + list(CODE_DTYPES)}")
    try:
        return state_dtype, state_rounding.parse_rounding(rounding)
    except ValueError as e:
        raise ValueError(f"--variants {name!r}: {e}") from None


def _patch(state_dtype: str, rounding: state_rounding.Rounding):
    """The rounding patched in for an 8-bit state, none for float state; the engine's own stochastic rounding for
    every state kind (the engine rounds some kinds to nearest: cache/spec.py, TEMPORAL_ROUNDING)."""
    if state_dtype not in CODE_DTYPES:
        return nullcontext()
    if rounding == ENGINE_ROUNDING:
        return _every_kind_stochastic()
    return state_rounding.patched(rounding)


@contextmanager
def _every_kind_stochastic() -> Iterator[None]:
    """Within the block, engines built round every 8-bit state kind stochastically."""
    saved = dict(spec.TEMPORAL_ROUNDING)
    spec.TEMPORAL_ROUNDING.clear()
    try:
        yield
    finally:
        spec.TEMPORAL_ROUNDING.update(saved)


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


def _logprobs(path: str, text: list[int], state_dtype: str,
              rounding: state_rounding.Rounding = ENGINE_ROUNDING, key: int = 0) -> list[float]:
    """The logprob of each next token of ``text`` (positions 1..len-1), fed one token per step; ``key`` is the
    request's seed, which 8-bit state's rounding is keyed on."""
    with _patch(state_dtype, rounding):
        llm = _engine(path, state_dtype, max_num_batched_tokens=1)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, seed=key)
        out = llm.generate([{"prompt_token_ids": text}], params)[0]
    return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], text[1:])]


def measure(path: str, label: str, prompt_len: int, generated: int, variants: list[str] = DEFAULT_VARIANTS,
            keys: tuple[int, ...] = (0,)) -> dict:
    """The figures of each variant (``<state dtype>/<rounding>``) on one checkpoint: mean, max and
    generated-half mean |Δlogprob| against float32 state, and ``x_bf16`` (the mean over bfloat16 state's,
    when bfloat16/nearest is among the variants). An 8-bit variant runs once per rounding key in ``keys``:
    its mean is the keys' average (``mean_per_key`` lists each), its max their max; a float one runs once."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    text = _text(path, vocab, prompt_len, generated)
    start = time.perf_counter()
    ref = _logprobs(path, text, "float32")
    result: dict = {"model": label, "positions": len(ref), "variants": {}}
    for name in variants:
        state_dtype, rounding = parse_variant(name)
        per_key = [_figures([abs(a - b) for a, b in zip(_logprobs(path, text, state_dtype, rounding, key), ref)],
                            prompt_len) for key in (keys if state_dtype in CODE_DTYPES else keys[:1])]
        result["variants"][name] = {
            "mean": sum(f["mean"] for f in per_key) / len(per_key), "max": max(f["max"] for f in per_key),
            "mean_generated": sum(f["mean_generated"] for f in per_key) / len(per_key),
            "mean_per_key": [f["mean"] for f in per_key]}
    bf16 = result["variants"].get("bfloat16/nearest", {}).get("mean")
    for figures in result["variants"].values():
        figures["x_bf16"] = figures["mean"] / bf16 if bf16 else None
    result["seconds"] = time.perf_counter() - start
    return result


def _figures(diffs: list[float], prompt_len: int) -> dict:
    tail = diffs[prompt_len - 1:]  # positions predicting the generated half
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "mean_generated": sum(tail) / max(len(tail), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--default-model", action="store_true", help="measure hybridserve/default_model")
    parser.add_argument("--family", nargs="*", default=[], help="tiny checkpoints of tests/checkpoints.py "
                        "(all temporal-state families with 'all')")
    parser.add_argument("--prompt", type=int, default=520)
    parser.add_argument("--generated", type=int, default=520)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                        help="<state dtype>/<rounding> each (see above); default: %(default)s")
    parser.add_argument("--keys", type=int, nargs="+", default=[0],
                        help="rounding keys (request seeds): each 8-bit variant's figures average over them")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    for name in args.variants:
        try:
            parse_variant(name)
        except ValueError as e:
            parser.error(str(e))
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
    print(f"CPU: {platform.processor() or platform.machine()}; {args.prompt} + {args.generated} tokens, one per step; "
          f"rounding keys {args.keys}")
    results = []
    for path, label in models:
        r = measure(path, label, args.prompt, args.generated, args.variants, tuple(args.keys))
        results.append(r)
        cells = "  ".join(f"{k} {v['mean']:.2e}" + (f" ({v['x_bf16']:.1f}x)" if v["x_bf16"] else "")
                          for k, v in r["variants"].items())
        print(f"{label:18s} {cells}  ({r['seconds']:.0f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
