"""CLI flags for every engine option (one place, shared by `generate`, `serve` and `plan`); imports no torch."""

from __future__ import annotations

import argparse
from typing import Any

from hybridserve.kernels.isa import CPU_ISA_CHOICES
from hybridserve.kernels.threads import WAIT_POLICIES
from hybridserve.options import (
    CONV_STATE_DTYPE_NAMES,
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS,
    DEFAULT_SNAPSHOT_INTERVAL,
    DEVICES,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPE_NAMES,
    MODEL_DTYPE_NAMES,
    QUANTIZATIONS,
    TEMPORAL_STATE_DTYPE_NAMES,
    conv_state_dtype,
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it, there is none (``None``), or the
    flag is a plain switch (``store_true`` / ``store_false``). Used by every ``hybridserve`` parser."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("%(default)" in text or "default:" in text or action.default in (None, argparse.SUPPRESS)
                or (action.nargs == 0 and isinstance(action.default, bool)
                    and not isinstance(action, argparse.BooleanOptionalAction))):
            return text
        return super()._get_help_string(action)


def add_dtype_args(parser: argparse.ArgumentParser) -> None:
    """The four dtype flags (docs/dtypes.md)."""
    parser.add_argument("--dtype", default="auto", choices=["auto", *MODEL_DTYPE_NAMES],
                        help="weights and activations (auto: the checkpoint's dtype)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPE_NAMES],
                        help="attention K/V cache (auto: the model dtype)")
    parser.add_argument("--mamba-cache-dtype", default="auto", type=_conv_state_dtype_arg, metavar="{auto,"
                        + ",".join(CONV_STATE_DTYPE_NAMES) + "}",
                        help="conv states (auto: the model dtype; int8: codes and a power-of-two exponent per "
                             "channel, docs/state_precision.md)")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", *TEMPORAL_STATE_DTYPE_NAMES],
                        help="recurrent (SSM / linear-attention / delta-net / mLSTM) states (auto: the checkpoint's "
                             "declared state dtype, else the conv-state dtype; int8 and fp8_e4m3: 8-bit codes and a "
                             "bfloat16 scale per state row, docs/state_precision.md)")


def _conv_state_dtype_arg(value: str) -> str:
    """``--mamba-cache-dtype``'s value checked by the options module (its message says why fp8 is refused)."""
    try:
        return conv_state_dtype(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine option of the offline API as a flag."""
    add_dtype_args(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output, in tokens (default: the model's max_position_embeddings, "
                             "at most 4096)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one step (prefill chunks plus decodes)")
    parser.add_argument("--cache-memory", default="1GiB", help="bytes of the shared KV + state pool, e.g. 2GiB")
    parser.add_argument("--block-size", type=int, default=16, help="attention KV block size in tokens (1-64)")
    parser.add_argument("--device", default="auto", choices=list(DEVICES), help="auto: CUDA when available")
    parser.add_argument("--seed", type=int, default=0, help="the engine's random seed")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--no-cpu-weight-prepack", dest="cpu_weight_prepack", action="store_false",
                        help="on the CPU, keep plain bf16 linear weights instead of oneDNN-prepacked ones "
                             "(same results, slower)")
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                        help="on the CPU, use the plain-PyTorch recurrent-layer paths instead of the compiled "
                             "C++ kernels (built on first use with the system compiler)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step through the model's modules, without replaying captured decode "
                             "steps (same results, slower)")
    parser.add_argument("--cpu-isa", default="auto", choices=list(CPU_ISA_CHOICES),
                        help="cap the CPU instruction set of the compiled kernels, oneDNN and ATen (auto: the "
                             "best this CPU has); a lower level runs, and tests, that level's kernel variants")
    parser.add_argument("--cpu-threads", type=threads_arg, default=None, metavar="N",
                        help="compute threads of the engine (default: auto, every core this process may use, "
                             "less --cpu-reserved-cores)")
    parser.add_argument("--cpu-reserved-cores", type=int, default=0, metavar="N",
                        help="cores left to the server's front end and other work: auto threads use the rest")
    parser.add_argument("--cpu-wait-policy", default="auto", choices=list(WAIT_POLICIES),
                        help="how idle OpenMP threads wait: spin (until work comes), bounded (spin briefly, then "
                             "sleep), passive (sleep at once), openmp (the runtime's default); auto is bounded, which "
                             "stalls far less than spinning when another process runs on the cores "
                             "(docs/performance.md; see also --cpu-adaptive-threads)")
    parser.add_argument("--cpu-adaptive-threads", action="store_true",
                        help="run fewer compute threads while other processes keep some of the cores busy, and return "
                             "to --cpu-threads when they leave (docs/performance.md, \"Shared cores\")")
    parser.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                        help="weights: int8 quantizes every linear (MoE experts and the LM head too) per output "
                             "channel at load, run on the CPU kernels; int4 likewise to 4-bit codes with a scale per "
                             "group of in-features (--quantization-group-size; a uint8 times a float16 per 256); "
                             "auto runs a checkpoint's own fp8 weights (quantization_config) as they are; none "
                             "dequantizes those at load; "
                             "w8a8 is int8 with each linear's activations quantized to int8 per row too (AMX-INT8 "
                             "tiles where present; MoE experts stay weight-only): docs/quantization.md")
    parser.add_argument("--quantization-group-size", type=int, default=None, choices=list(INT4_GROUP_SIZES),
                        metavar="N", help=f"in-features per scale of --quantization int4: "
                                          f"{', '.join(map(str, INT4_GROUP_SIZES))} (default "
                                          f"{DEFAULT_INT4_GROUP_SIZE})")
    parser.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                        help="resume prompts from cached prefixes: shared KV pages and recurrent-state "
                             "snapshots in the one pool, evicted whenever requests need the room")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\', '
                             '\'{"model": "DRAFT_DIR", "num_speculative_tokens": 4}\' or \'{"method": "mtp"}\' '
                             "(docs/spec_decode.md)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks (processes) the model is sharded over, on this host or under a torchrun-style "
                             "launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): docs/tensor_parallel.md")
    parser.add_argument("--prefix-snapshot-interval", type=int, default=DEFAULT_SNAPSHOT_INTERVAL,
                        help="tokens between the state snapshots of a long prefill (0: only at prompt ends, "
                             "generation ends and branch points)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="where the sampling defaults of requests that leave them unset come from: auto, the "
                             "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens as max_tokens); vllm, none (the engine's defaults); DIR, that folder's "
                             "generation_config.json. A request's own values always win")
    add_grammar_limit_args(parser)


def add_grammar_limit_args(parser: argparse.ArgumentParser) -> None:
    """Structured output's grammar limits (docs/structured_output.md)."""
    parser.add_argument("--max-grammar-bytes", type=int, default=DEFAULT_MAX_GRAMMAR_BYTES, metavar="N",
                        help="longest structured-output constraint (JSON schema, regex, grammar, or the choices as "
                             "a JSON list), in UTF-8 bytes; a longer one is refused (HTTP 400)")
    parser.add_argument("--max-grammar-compile-seconds", type=float, default=DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS,
                        metavar="S", help="longest a request waits for its grammar to compile (in one worker "
                                          "thread, queueing included); past it the request is refused (HTTP 400)")
    parser.add_argument("--grammar-cache-bytes", default=f"{DEFAULT_GRAMMAR_CACHE_BYTES // 2 ** 20}MiB",
                        metavar="SIZE", help="estimated memory of the compiled grammars kept for reuse (bytes or a "
                                             "size such as 64MiB; 0 keeps none); least recently used dropped first")


ENGINE_FIELDS = ("dtype", "kv_cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "max_model_len",
                 "max_num_seqs", "max_num_batched_tokens", "cache_memory", "block_size", "device", "seed",
                 "tokenizer", "cpu_weight_prepack", "cpu_kernels", "enforce_eager", "cpu_isa", "cpu_threads",
                 "cpu_reserved_cores", "cpu_wait_policy", "cpu_adaptive_threads", "quantization",
                 "quantization_group_size", "enable_prefix_caching", "prefix_snapshot_interval", "speculative_config",
                 "tensor_parallel_size", "max_grammar_bytes", "max_grammar_compile_seconds", "grammar_cache_bytes",
                 "generation_config")


def threads_arg(value: str) -> int | None:
    """``--cpu-threads``: a count, or ``auto`` (None); the range is checked by EngineConfig."""
    if value.strip().lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a thread count (an integer, or auto)") from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments of parsed flags."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)}
