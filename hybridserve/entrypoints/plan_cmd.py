"""``hybridserve plan``: cache layout and capacity of a model, from its config.json alone.

The config is read with transformers' config class and the model built on the meta device (no weights, no
memory), so the plan's specs are the engine's own (``planning/planner.py``).
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridserve.entrypoints.engine_args import HelpFormatter, add_dtype_args
from hybridserve.options import DEFAULT_INT4_GROUP_SIZE, DEFAULT_SNAPSHOT_INTERVAL, INT4_GROUP_SIZES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="cache layout and capacity from config.json alone (no weights, no tokenizer)",
        formatter_class=HelpFormatter,
        description="Cached tensors per kind of layer, state bytes per sequence, KV bytes per token, the attention "
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
    p.add_argument("--device", default="auto", help="the engine's device (auto, cpu, cuda)")
    p.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="plan for an engine without its CPU kernels (captured decode or not, the pool's capacity "
                        "is the same: padded rows hold no page and no slot)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="plan for an engine that does not capture decode steps (the same capacity)")
    p.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                   help="plan for an engine that caches prefixes: shows what a state snapshot costs")
    p.add_argument("--prefix-snapshot-interval", type=int, default=DEFAULT_SNAPSHOT_INTERVAL,
                   help="tokens between the state snapshots of a long prefill (0: none periodic)")
    p.add_argument("--speculative-config", default=None,
                   help="speculative decoding as JSON (as for generate/serve): the drafter's layers and the "
                        "verification slot are counted")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="plan one rank of this many (its slice of every cache tensor, its pool of --cache-memory "
                        "bytes); reads the config through transformers and shards the model as the engine does")
    p.add_argument("--quantization-group-size", type=int, default=DEFAULT_INT4_GROUP_SIZE,
                   choices=list(INT4_GROUP_SIZES), metavar="N",
                   help="in-features per scale of the --quantization int4 weight estimate")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of tables: every layer (layers) and the kinds of layer "
                        "with their counts (layer_groups)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hybridserve.planning.plan_config import PlanConfig
    from hybridserve.planning.planner import (
        DTYPE_OPTIONS,
        load_config,
        plan_alternatives,
        plan_cache,
        positions_warning,
    )

    config = PlanConfig(block_size=args.block_size, cache_memory=args.cache_memory,
                        max_model_len=args.max_model_len, device=args.device, cpu_kernels=args.cpu_kernels,
                        enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
                        prefix_snapshot_interval=args.prefix_snapshot_interval,
                        speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
                        **{name: getattr(args, name) for name in DTYPE_OPTIONS})
    hf_config = load_config(args.model)
    plan = plan_cache(hf_config, config)
    warning = positions_warning(hf_config, plan.max_model_len, "--max-model-len")
    if warning is not None:
        print(warning, file=sys.stderr)
    alternatives = plan_alternatives(hf_config, config)
    from hybridserve.planning.weight_plan import weight_bytes

    weights = weight_bytes(args.model, bool(getattr(hf_config, "tie_word_embeddings", False)),
                           args.quantization_group_size)
    if args.json:
        print(json.dumps({**plan.to_dict(), "layer_groups": layer_groups(plan.specs),
                          "alternatives": [a.summary() for a in alternatives], "weight_bytes": weights}, indent=2))
    else:
        print_plan(plan, alternatives)
        print_weights(weights, args.quantization_group_size)
        if weights is not None and plan.tensor_parallel_size > 1:
            print(f"weights per rank: about 1/{plan.tensor_parallel_size} of these (norms, routers and the "
                  "projections inside low-rank gates are whole on every rank)")
    return 0


def print_weights(weights: dict | None, int4_group: int = DEFAULT_INT4_GROUP_SIZE) -> None:
    """Weight bytes per dtype: as stored, and with --quantization int8 and int4 (estimates from names and
    shapes)."""
    if weights is None:
        print("weights: no safetensors here (config.json only)")
        return
    for label, key in (("checkpoint", "checkpoint"), ("with --quantization int8 (estimate)", "int8"),
                       (f"with --quantization int4, groups of {int4_group} (estimate)", "int4")):
        parts = weights[key]
        total = sum(parts.values())
        print(f"weights, {label}: {_size(total)} (" + ", ".join(f"{_short(k)} {_size(v)}" for k, v in parts.items())
              + ")")


def layer_groups(specs) -> list[dict]:
    """The layers grouped by what they cache: one entry per distinct kind, tensor names, shapes and dtypes, in
    the order each first appears, with its layer indices and their count."""
    groups: dict[str, dict] = {}
    for spec in specs:
        entry = spec.describe()
        key = json.dumps([entry["kind"], entry["tensors"]])
        group = groups.get(key)
        if group is None:
            groups[key] = group = {"kind": entry["kind"], "layers": [], "count": 0, "tensors": entry["tensors"],
                                   "kv_bytes_per_token": entry["kv_bytes_per_token"],
                                   "state_bytes_per_sequence": entry["state_bytes_per_sequence"]}
        group["layers"].append(entry["index"])
        group["count"] += 1
    return list(groups.values())


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    parts, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


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
    from rich.console import Console, JustifyMethod
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # a pipe or a file: no terminal width to fit
    names = plan.dtypes.as_names()
    console.print(f"[bold]{plan.architecture}[/bold]  " + "  ".join(f"{k}={v}" for k, v in names.items()))
    if plan.tensor_parallel_size > 1:
        console.print(f"tensor parallel: {plan.tensor_parallel_size} ranks; every figure below is one rank's (each "
                      "rank's pool holds its slice of every cache tensor)")
    layers = Table(title="Cached tensors per layer (one row per kind of layer, \u00d7 how many)", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("count", "right"), ("kind", "left"), ("tensor", "left"), ("shape", "left"), ("dtype", "left"),
        ("bytes each", "right"), ("layers", "left"))
    for col, justify in columns:
        layers.add_column(col, justify=justify, no_wrap=col != "layers", min_width=8 if col == "layers" else None)
    for group in layer_groups(plan.specs):
        for i, t in enumerate(group["tensors"]):
            per = "token" if t["per"] == "token" else "seq"
            first = i == 0
            layers.add_row(f"\u00d7{group['count']}" if first else "", group["kind"] if first else "", t["name"],
                           "(" + ", ".join(map(str, t["shape"])) + ")", _short(t["dtype"]), f"{t['bytes']:,}/{per}",
                           _ranges(group["layers"]) if first else "")
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
            ("cache memory" + (" per rank" if plan.tensor_parallel_size > 1 else ""),
             f"{s['cache_memory_bytes']:,} ({_size(s['cache_memory_bytes'])})"
             + (f"; {_size(s['all_ranks_pool_bytes'])} over {plan.tensor_parallel_size} ranks"
                if plan.tensor_parallel_size > 1 else "")),
            ("bytes per sequence", f"{s['bytes_per_sequence']:,} at {s['max_model_len']:,} tokens "
                                   f"(ideal {s['ideal_bytes_per_sequence']:,})"),
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
    spec = s["speculation"]
    if spec is not None:
        totals.add_row("speculation", f"{spec['method']}, {spec['num_speculative_tokens']} drafts; drafter cache "
                       f"layers {spec['drafter_cache_layers']}; verification slot "
                       f"{_size(spec['verification_slot_bytes'])} per sequence")
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
