"""``hybridserve env``: the machine, versions, the CPU ISA in force and each kernel's variant; with
``--model``, also the fast paths an engine of that model runs with (decode captured, and why not) and
the kernel fallbacks of a short generation (prefill and decode steps)."""

from __future__ import annotations

import argparse
import json
import logging

from hybridserve.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="machine, versions, CPU ISA and kernel variants (and a model's fast paths)",
                       formatter_class=HelpFormatter,
                       description="Report the CPU, its features and the ISA level in force, torch / transformers / "
                                   "hybridserve versions, the kernel cache folder and, per op, the kernel variant "
                                   "used or why it falls back. With --model, an engine is started with the given "
                                   "flags and its fast paths are reported too (decode captured, and why not), with the "
                                   "calls a short generation ran in plain PyTorch (kernel fallbacks).")
    p.add_argument("--model", default=None, help="checkpoint directory: also report this model's fast paths")
    add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run, cache_memory="64MiB")


def model_fast_paths(args: argparse.Namespace) -> dict:
    """Start an engine on ``args.model``, run a short generation (two sequences: prefill, then decode
    steps) and return its fast-path report with the kernel fallbacks counted meanwhile."""
    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.kernels import fallbacks
    from hybridserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, enable_progress_bar=False, **engine_kwargs(args)))
    report = engine.cpu_fast_paths.as_dict() if engine.cpu_fast_paths is not None else {
        "decode": {"captured": False, "reason": f"the engine runs on {engine.device}, not the CPU"}}
    before = fallbacks.counts()
    vocab = engine.hf_config.vocab_size
    for i, length in enumerate((5, 9)):
        engine.add_request(f"env-{i}", [(7 * t + i) % vocab for t in range(length)],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()  # tensor-parallel workers, if any
    declined = [{"op": op, "reason": reason, "calls": n - before.get((op, reason), 0)}
                for (op, reason), n in sorted(fallbacks.counts().items()) if n > before.get((op, reason), 0)]
    return {"model": args.model, "architecture": type(engine.model).__name__,
            "dtypes": engine.dtypes.as_names(), **report, "kernel_fallbacks": declined}


def run(args: argparse.Namespace) -> int:
    from hybridserve.kernels import isa
    from hybridserve.kernels.report import environment
    from hybridserve.kernels.threads import setup_threads

    isa.set_cap(args.cpu_isa)
    logging.getLogger("hybridserve").setLevel(logging.ERROR)  # the report says what the log would
    setup = setup_threads(args.cpu_threads, args.cpu_reserved_cores, args.cpu_wait_policy)  # as an engine would
    report = environment(setup)
    if args.model is not None:
        report["model"] = model_fast_paths(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    cpu, isa_, kernels = report["cpu"], report["isa"], report["kernels"]
    have = [f for f, on in cpu["features"].items() if on]
    print(f"CPU: {cpu['model']} ({cpu['arch']}); features: {', '.join(have) or 'none of those checked'}")
    print(f"ISA in force: {isa_['in_force']} (best {cpu['best_isa']}, cap {isa_['cap']}); ATen: "
          f"{isa_['aten_cpu_capability']}; oneDNN cap: {isa_['onednn_max_cpu_isa'] or 'none'}; "
          f"oneDNN bf16: {isa_['onednn_bf16']}")
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    print(f"versions: {versions}")
    threads, policy = report["cpu_threads"], report["cpu_threads"]["wait_policy"]
    print(f"threads: {threads['threads']} ({threads['reason']}; {threads['cpus']} CPUs usable); OpenMP runtime "
          f"{threads['openmp_runtime'] or 'none loaded'}, wait policy {policy['description']}"
          + (f"; note: {policy['note']}" if policy["note"] else ""))
    compiler = kernels["compiler_version"] or kernels["compiler"] or "none"
    print(f"compiler: {compiler}; kernel cache: {kernels['cache_dir']}")
    for op, row in kernels["ops"].items():
        reason = f" ({row['fallback_reason']})" if row["fallback_reason"] else ""
        print(f"  {op:18s} {row['variant']}{reason}")
    model = report.get("model")
    if model is not None:
        print(f"model: {model['model']} ({model['architecture']}, {model['dtypes']})")
        decode = model["decode"]
        print(f"  decode: {'captured' if decode['captured'] else 'eager'}"
              + (f" ({decode['reason']})" if decode["reason"] else ""))
        declined = model.get("kernel_fallbacks", [])
        print("  kernel fallbacks: " + ("; ".join(f"{d['op']} ({d['reason']}) x{d['calls']}" for d in declined)
                                        if declined else "none"))
        if "linears" in model:
            print("  linears: " + ", ".join(f"{k} {v}" for k, v in model["linears"].items()))
        weights = model.get("weights")
        if weights is not None:
            four, q6k = weights.get("4bit"), weights.get("q6_k")
            print(f"  weights: quantization {weights['quantization']}"
                  + (f"; 8-bit kernel {weights['kernel']}" if weights["kernel"] else "")
                  + (f"; 4-bit linears and expert blocks {four['linears']}, kernel {four['kernel']}" if four else "")
                  + (f"; Q6_K linears {q6k['linears']}, kernel {q6k['kernel']}" if q6k else ""))
