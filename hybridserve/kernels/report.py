"""What the CPU kernels are on this machine: the CPU, the ISA in force, and each op's variant (or why
it falls back to plain PyTorch). ``hybridserve env`` prints it."""

from __future__ import annotations

import platform
import subprocess

from hybridserve.kernels import build, isa
from hybridserve.kernels import threads as cpu_threads

#: op -> (library, what the op is)
OPS = {
    "linear_bf16": ("gemm", "bf16 linear layers and MoE experts"),
    "linear_f16": ("gemm", "fp16 linear layers and MoE experts"),
    "linear_w8": ("gemm", "8-bit weight linears and MoE experts (int8, fp8 e4m3)"),
    "linear_w8a8": ("gemm", "int8 weight linears with int8 activations (--quantization w8a8)"),
    "linear_w4": ("gemm", "4-bit group-wise weight linears and MoE experts (--quantization int4)"),
    "linear_w6k": ("gemm", "GGUF Q6_K weight linears kept 6-bit (and a tied Q6_K LM head)"),
    "rms_norm": ("pointwise", "RMS norm (with the residual add)"),
    "gated_rms_norm": ("pointwise", "Mamba2 gated group RMS norm"),
    "silu_mul": ("pointwise", "silu(a) * b"),
    "rotary": ("pointwise", "RoPE"),
    "argmax_logsumexp": ("pointwise", "greedy sampling"),
    "causal_conv1d": ("recurrent", "causal depthwise conv with state"),
    "mamba2_scan": ("recurrent", "Mamba2 state update / scan"),
    "kv_write": ("attention", "KV cache write"),
    "paged_attention": ("attention", "paged attention"),
    "graph_replay": ("graph", "captured decode steps replayed in one C++ call"),
}


def _variant(op: str, level: str) -> str:
    if op == "linear_bf16":
        from hybridserve.kernels import gemm

        if gemm.amx_rows() > 0:
            odd = "AVX-512 BF16 dot products" if gemm.uses_bf16_dot() else "weights widened to float32"
            return (f"{level}: AMX-BF16 tiles for calls of {gemm.amx_rows()}+ rows (every row count: decode and "
                    f"prefill); odd in-features on {odd}")
        if gemm.uses_bf16_dot():
            return "avx512_bf16: AVX-512 BF16 dot products"
        if isa.at_least("avx512_bf16"):
            return (f"{level}: weights widened to float32 in registers (on this {isa.cpu_info().vendor} CPU faster "
                    "than AVX-512 BF16 dot products)")
        return f"{level}: weights widened to float32 in registers"
    if op == "linear_f16":
        return f"{level}: weights widened to float32 in registers"
    if op == "linear_w8":
        return w8_variant(level)
    if op == "linear_w4":
        return w4_variant(level)
    if op == "linear_w6k":
        return w6k_variant(level)
    if op == "linear_w8a8":
        from hybridserve.kernels import linear_w8

        sums = linear_w8.w8a8_sums() or "integer vectors"
        if linear_w8.w8a8_on_tiles():
            sums = f"AVX-512 VNNI up to {linear_w8.W8A8_VNNI_ROWS} rows, {sums} above"
        return f"{level}: activations quantized per row, exact int32 sums on {sums}"
    if op == "mamba2_scan":
        return mamba2_scan_variant(level)
    return f"{level}: compiled"


def w8_variant(level: str | None = None) -> str:
    """The 8-bit weight linears' variant at ``level`` (default: the level in force)."""
    level = level or isa.level_in_force()
    fma = f"8-bit codes widened to float32 in registers ({_vector_lanes(level)}), float32 sums, a scale per channel"
    if level == "amx":
        from hybridserve.kernels import linear_w8

        return (f"{level}: bf16 calls of {linear_w8.AMX_ROWS}+ rows on AMX-BF16 tiles over codes widened exactly to "
                f"bf16 (per k-step up to 32 rows, once per call above); others {fma}")
    if level == "avx512_bf16":
        from hybridserve.kernels import gemm

        if gemm.uses_bf16_dot():
            return (f"{level}: bf16 calls of 4+ rows on AVX-512 BF16 dot products over codes widened once per "
                    f"call to bf16; others {fma}")
    return f"{level}: {fma}"


def _vector_lanes(level: str) -> str:
    """The float32 vector path's registers at ``level``, in words."""
    return {"generic": "portable vectors", "avx2": "AVX2 + FMA, 8 lanes"}.get(level, "AVX-512 + FMA, 16 lanes")


def _integer_sums(level: str) -> str | None:
    """The instructions of the coded-weight linears' few-row integer sums at ``level``, in words (None: no such
    path there)."""
    if level in ("avx512_bf16", "amx"):
        return "AVX-512 VNNI (vpdpbusd)"
    return "AVX2 integer vectors (vpmaddubsw, vpmaddwd)" if level in ("avx2", "avx512") else None


def _coded_variant(level: str, few_rows: str | None, amx_rows: str, vector: str, widened_rows: int,
                   dot_rows: int) -> str:
    """The paths of a coded-weight linear (4-bit, Q6_K) at ``level``: the few-row integer path where ``few_rows``
    names one, the AMX tiles for many bf16 rows at amx, at avx512_bf16 on CPUs that prefer its dot products the
    dot products over codes widened to bf16 for bf16 calls of ``dot_rows`` rows or more, float32 panels decoded
    once per row block for the other calls of ``widened_rows`` rows or more, the float32 vector path for the rest."""
    panels = (f"codes decoded once per row block into float32 panels, float32 tiles over them "
              f"({_vector_lanes(level)})")
    if level == "amx":
        return f"{level}: {few_rows}; {amx_rows}; other calls of more rows: {panels}"
    if level == "avx512_bf16":
        from hybridserve.kernels import gemm

        if gemm.uses_bf16_dot():
            dot = (f"bf16 calls of {dot_rows}+ rows (prefill, batches) on AVX-512 BF16 dot products over the codes "
                   "dequantized to bf16 once per call")
            return f"{level}: {few_rows}; {dot}; other calls of more rows: {panels}"
    if few_rows is not None:
        return f"{level}: {few_rows}; more rows: {panels}"
    return f"{level}: calls of {widened_rows}+ rows: {panels}; fewer rows: {vector}"


def w4_variant(level: str | None = None) -> str:
    """The 4-bit weight linears' variant at ``level`` (default: the level in force): which path each shape class
    (calls by rows, activation dtype) takes."""
    from hybridserve.kernels import linear_w4

    level = level or isa.level_in_force()
    vector = (f"4-bit codes dequantized in registers ({_vector_lanes(level)}), float32 sums per group times its "
              "scale (float16, or uint8 times a float16 per 256 in-features); in-features and group multiples of 8")
    sums = _integer_sums(level)
    w4a8 = None if sums is None else (
        f"calls of up to {linear_w4.W4A8_MAX_ROWS} rows (decode), every activation dtype, on W4A8: activations "
        f"quantized to int8 per weight group, nibble x int8 sums exact in int32 on {sums}")
    amx = (f"bf16 calls of {linear_w4.AMX_ROWS}+ rows (prefill, batches) on AMX-BF16 tiles over each column block's "
           "codes dequantized to bf16 once per row chunk")
    return _coded_variant(level, w4a8, amx, vector, linear_w4.WIDENED_ROWS, linear_w4.DOT_ROWS)


def w6k_variant(level: str | None = None) -> str:
    """The Q6_K weight linears' variant at ``level`` (default: the level in force): which path each shape class
    (calls by rows, activation dtype) takes."""
    from hybridserve.kernels import linear_w6k

    level = level or isa.level_in_force()
    vector = f"6-bit codes widened to float32 in registers ({_vector_lanes(level)}), float32 sums per 16 times d * sc"
    sums = _integer_sums(level)
    a8 = None if sums is None else (
        f"calls of up to {linear_w6k.A8_MAX_ROWS} rows (decode), every activation dtype, on int8 activations "
        f"per 256 k: 6-bit x int8 sums exact in int32 on {sums}")
    amx = (f"bf16 calls of {linear_w6k.AMX_ROWS}+ rows (prefill, batches) on AMX-BF16 tiles over codes widened to "
           "bf16 once per call")
    return _coded_variant(level, a8, amx, vector, linear_w6k.WIDENED_ROWS, linear_w6k.DOT_ROWS)


def mamba2_scan_variant(level: str | None = None) -> str:
    """Which Mamba2 scan path each case takes at ``level`` (default: the level in force)."""
    from hybridserve.kernels import recurrent

    level = level or isa.level_in_force()
    token = "float32 token-by-token recurrence"
    if level != "amx":
        return f"{level}: {token} (the chunked form on AMX tiles needs the amx level)"
    return (f"{level}: prefill sequences of {recurrent.CHUNKED_SCAN_MIN_TOKENS}+ tokens with bf16 activations, "
            f"head_dim a multiple of 16 and d_state of 32: chunked (SSD) form, chunks of "
            f"{recurrent.CHUNKED_SCAN_CHUNK} tokens, products on AMX-BF16 tiles, state float32 between chunks; "
            f"decode, shorter sequences, float32/float16 activations and other shapes: {token}")


def op_variants() -> dict[str, dict[str, str | None]]:
    """Per op: the variant in use at the level in force, or the plain-PyTorch fallback and why."""
    level = isa.level_in_force()
    libraries = {lib for lib, _ in OPS.values()}
    loaded = build.load_libraries(sorted(libraries), level)
    out = {}
    for op, (library, what) in OPS.items():
        if loaded.get(library) is not None:
            out[op] = {"what": what, "variant": _variant(op, level), "fallback_reason": None}
        else:
            out[op] = {"what": what, "variant": "plain PyTorch",
                       "fallback_reason": build.unavailable_reason(library, level) or "not built"}
    return out


def compiler_version(compiler: str | None) -> str | None:
    """The first line of ``compiler --version``."""
    if compiler is None:
        return None
    try:
        proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.splitlines()[0] if proc.stdout else None


def threads_report(setup: cpu_threads.ThreadSetup | None = None) -> dict:
    """The thread count and the OpenMP wait policy in force (``setup``: what an engine's options resolved to)."""
    import torch

    if setup is None:
        policy = cpu_threads.wait_policy_in_force()
        out = {"threads": torch.get_num_threads(), "cores": cpu_threads.usable_cores(),
               "cpus": cpu_threads.usable_cpus(), "reserved": None, "reason": "torch's thread count",
               "wait_policy": policy.as_dict()}
    else:
        out = setup.as_dict()
    return {**out, "threads": torch.get_num_threads(), "openmp_runtime": cpu_threads.openmp_runtime()}


def environment(thread_setup: cpu_threads.ThreadSetup | None = None) -> dict:
    """The machine, library versions, ISA and kernel facts (``hybridserve env``); ``thread_setup``: the threads
    the engine options resolved to."""
    import torch
    import transformers

    import hybridserve

    info = isa.cpu_info()
    compiler = build.find_compiler()
    return {
        "cpu": {"model": info.model, "arch": info.arch, "python_platform": platform.platform(),
                "features": {f: f in info.features for f in isa.REPORTED_FEATURES},
                "best_isa": info.best_level},
        "isa": {"in_force": isa.level_in_force(), "cap": isa.cap(), **isa.torch_isa_report(),
                "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())},
        "versions": {"hybridserve": hybridserve.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "threads": torch.get_num_threads(),
        "cpu_threads": threads_report(thread_setup),
        "kernels": {"compiler": compiler, "compiler_version": compiler_version(compiler),
                    "cache_dir": str(build.cache_dir()), "ops": op_variants()},
    }
