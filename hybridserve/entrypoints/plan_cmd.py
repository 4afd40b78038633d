"""``hybridserve plan``: cache layout and capacity of a model, from its config.json alone."""

from __future__ import annotations

import argparse
import json

from hybridserve.cache.prefix_cache import DEFAULT_SNAPSHOT_INTERVAL
from hybridserve.entrypoints.engine_args import add_dtype_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="cache layout and capacity from config.json alone (no weights, no tokenizer)",
        description="Per-layer cached tensors, state bytes per sequence, KV bytes per token, the attention "
                    "block size and how many sequences of max-model-len tokens fit in the cache memory; the "
                    "same figures for the main alternatives. Reads config.json only: plan for models you "
                    "have not downloaded.")
    p.add_argument("model", metavar="MODEL_OR_CONFIG_DIR",
                   help="a checkpoint directory, a directory holding only config.json, or a config.json file")
    add_dtype_args(p)
    p.add_argument("--cache-memory", default="1GiB", help="bytes of the shared KV + state pool, e.g. 40GiB")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence (default: the engine's, the model's max positions capped at 4096)")
    p.add_argument("--block-size", type=int, default=16, help="attention KV block size in tokens (1-64)")
    p.add_argument("--device", default="auto", help="the engine's device (auto, cpu, cuda): captured decode steps "
                                                    "on the CPU set a page and a slot aside for padded rows")
    p.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="plan for an engine without its CPU kernels (no captured decode, no padding reservation)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="plan for an engine that does not capture decode steps (no padding reservation)")
    p.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                   help="plan for an engine that caches prefixes (default: on): shows what a state snapshot costs")
    p.add_argument("--prefix-snapshot-interval", type=int, default=DEFAULT_SNAPSHOT_INTERVAL,
                   help="tokens between the state snapshots of a long prefill (0: none periodic)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hybridserve.cache.planner import DTYPE_OPTIONS, load_config, plan_alternatives, plan_cache
    from hybridserve.config import EngineConfig

    config = EngineConfig(block_size=args.block_size, cache_memory=args.cache_memory,
                          max_model_len=args.max_model_len, device=args.device, cpu_kernels=args.cpu_kernels,
                          enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
                          prefix_snapshot_interval=args.prefix_snapshot_interval,
                          **{name: getattr(args, name) for name in DTYPE_OPTIONS})
    hf_config = load_config(args.model)
    plan = plan_cache(hf_config, config)
    alternatives = plan_alternatives(hf_config, config)
    if args.json:
        print(json.dumps({**plan.to_dict(), "alternatives": [a.summary() for a in alternatives]}, indent=2))
    else:
        print_plan(plan, alternatives)
    return 0


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _flags(options: dict[str, str]) -> str:
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in options.items() if v != "auto"]
    return " ".join(flags) or "(all auto)"


def print_plan(plan, alternatives) -> None:
    """Human output: the per-layer table, the totals, and the alternatives (rich tables)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    names = plan.dtypes.as_names()
    console.print(f"[bold]{plan.architecture}[/bold]  " + "  ".join(f"{k}={v}" for k, v in names.items()))
    layers = Table(title="Cached tensors per layer", title_justify="left")
    for col, justify in (("layer", "right"), ("kind", "left"), ("tensor", "left"), ("shape", "left"),
                         ("dtype", "left"), ("bytes", "right")):
        layers.add_column(col, justify=justify, no_wrap=True)
    for spec in plan.specs:
        entry = spec.describe()
        for i, t in enumerate(entry["tensors"]):
            layers.add_row(str(entry["index"]) if i == 0 else "", entry["kind"] if i == 0 else "", t["name"],
                           "(" + ", ".join(map(str, t["shape"])) + ")", t["dtype"],
                           f"{t['bytes']:,} /{'token' if t['per'] == 'token' else 'seq'}")
    console.print(layers)
    s = plan.summary()
    totals = Table(show_header=False, title="Totals", title_justify="left")
    totals.add_column(justify="left")
    totals.add_column(justify="right")
    for label, value in (
            ("state bytes per sequence", f"{s['state_bytes_per_sequence']:,} ({_size(s['state_bytes_per_sequence'])})"),
            ("KV bytes per token", f"{s['kv_bytes_per_token']:,}"),
            ("attention block size", f"{s['attention_block_size']} tokens"),
            ("KV page / state slot", f"{s['page_bytes']:,} B / {s['slot_bytes']:,} B"),
            ("cache memory", f"{s['cache_memory_bytes']:,} ({_size(s['cache_memory_bytes'])})"),
            ("bytes per sequence", f"{s['bytes_per_sequence']:,} at {s['max_model_len']:,} tokens "
                                   f"(ideal {s['ideal_bytes_per_sequence']:,})"),
            ("padding reserved (captured decode)", _size(s["padding_reserved_bytes"])),
            ("max concurrent sequences", f"{s['max_concurrent_sequences']:,} of {s['max_model_len']:,} tokens "
                                         f"(ideal {s['ideal_max_sequences']:,.2f})")):
        totals.add_row(label, value)
    if s["snapshot_bytes"]:
        equivalent = s["snapshot_kv_token_equivalent"]
        totals.add_row("prefix-cache state snapshot", f"{_size(s['snapshot_bytes'])} (one slot"
                       + (f", the KV of {equivalent:,.0f} tokens)" if equivalent else ")"))
        totals.add_row("snapshots of one max-len prefill",
                       f"{s['snapshots_per_max_len_prefill']} ({_size(s['snapshot_bytes_per_max_len_prefill'])}; "
                       f"every {s['prefix_snapshot_interval']:,} tokens and the prompt's end)"
                       if s["prefix_snapshot_interval"] else
                       f"{s['snapshots_per_max_len_prefill']} (the prompt's end)")
    console.print(totals)
    alt = Table(title=f"Alternatives ({_size(s['cache_memory_bytes'])}, {s['max_model_len']:,} tokens, "
                      f"block {s['attention_block_size']})", title_justify="left")
    for col in ("configuration", "KV", "conv", "SSM", "state/seq", "KV B/token", "max seqs"):
        alt.add_column(col, justify="left" if col in ("configuration", "KV", "conv", "SSM") else "right",
                       no_wrap=col != "configuration")
    for p in [plan, *alternatives]:
        n = p.dtypes.as_names()
        alt.add_row(p.label, _short(n["kv_cache_dtype"]), _short(n["mamba_cache_dtype"]),
                    _short(n["mamba_ssm_cache_dtype"]), _size(p.layout.state_bytes_per_sequence),
                    f"{p.layout.kv_bytes_per_token:,}", f"{p.max_concurrent_sequences:,}")
    console.print(alt)
    console.print("requested: " + _flags(plan.options))


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
