"""Run one workload on llama.cpp's own benchmark tools; results in side_by_side.py's terms.

Build llama.cpp (CPU, ``-DGGML_NATIVE=ON``) with the targets ``llama-batched-bench`` and
``llama-bench``, and convert the checkpoint with make_gguf.py. ``llama-batched-bench`` is the
batched peer: REQUESTS separate (not shared) prompts of PROMPT random tokens, prefilled together,
then decoded together step by step. Its decode steps feed random tokens and skip sampling, so it
reports speed only (no tokens to compare). ``llama-bench`` gives the one-stream figures: prefill
of P tokens and decode of N tokens, each from an empty context.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def tool(folder: str, name: str) -> str | None:
    """Path of llama.cpp's ``name`` binary in ``folder`` (a build folder or its bin/), if there."""
    for path in (os.path.join(folder, name), os.path.join(folder, "bin", name)):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def default_gguf(model: str, dtype: str) -> str:
    """``model``/model-<type>.gguf for the run's dtype (``auto``: the checkpoint's own dtype)."""
    if dtype == "auto":
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return os.path.join(model, f"model-{GGUF_TYPES.get(dtype, 'bf16')}.gguf")


def _run(cmd: list[str]) -> tuple[int, str, str, float]:
    """Run ``cmd``; return its exit code, stdout, stderr and peak RSS (MiB, from its own rusage)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), usage.ru_maxrss / 1024


def _jsonl_rows(text: str) -> list[dict]:
    """The JSON objects of llama-batched-bench's ``--output-format jsonl`` lines (C's ``nan`` read as NaN)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            rows.append(json.loads(re.sub(r"-?\bnan\b", "NaN", line)))
    return rows


def batched_command(binary: str, gguf: str, n: int, plen: int, olen: int, threads: int,
                    extra: list[str]) -> list[str]:
    """llama-batched-bench's command line for ``n`` prompts of ``plen`` tokens and ``olen`` outputs.

    The other engines produce ``olen`` tokens from one prefill and ``olen - 1`` decode steps, so
    llama.cpp is asked for ``olen - 1`` decode steps (its -ntg counts steps after the prefill)."""
    return [binary, "-m", gguf, "-t", str(threads), "-npl", str(n), "-npp", str(plen),
            "-ntg", str(max(olen - 1, 1)), "-c", str(n * (plen + olen)), "--output-format", "jsonl", *extra]


def run_batched(folder: str, gguf: str, n: int, plen: int, olen: int, threads: int,
                extra: list[str] | None = None) -> dict | None:
    """One llama-batched-bench run in side_by_side.py's result format, or None (reason on stderr)."""
    binary = tool(folder, "llama-batched-bench")
    if binary is None:
        raise FileNotFoundError(f"no llama-batched-bench in {folder}")
    rc, out, err, rss = _run(batched_command(binary, gguf, n, plen, olen, threads, extra or []))
    rows = [r for r in _jsonl_rows(out + "\n" + err) if r.get("pl") == n and r.get("pp") == plen]
    if rc != 0 or not rows:
        print(f"llama.cpp run failed (exit {rc}):\n{err[-3000:]}", file=sys.stderr)
        return None
    r = rows[-1]
    steps = r["tg"]
    seconds = r["t_pp"] + r["t_tg"]
    generated = n * olen
    return {"engine": "llama.cpp", "seconds": seconds, "generated_tokens": generated,
            "tokens_per_s": generated / seconds, "ttft_s": r["t_pp"], "itl_s": r["t_tg"] / steps,
            "prefill_tok_s": r["speed_pp"], "decode_tok_s": r["speed_tg"], "peak_rss_mib": rss,
            "n_kv_max": r.get("n_kv_max"), "n_batch": r.get("n_batch"), "n_ubatch": r.get("n_ubatch"),
            "flash_attn": r.get("flash_attn")}


def run_one_stream(folder: str, gguf: str, plen: int, olen: int, threads: int,
                   extra: list[str] | None = None) -> dict | None:
    """llama-bench's one-stream prefill (``plen`` tokens) and decode (``olen`` tokens) rates, tok/s."""
    binary = tool(folder, "llama-bench")
    if binary is None:
        raise FileNotFoundError(f"no llama-bench in {folder}")
    cmd = [binary, "-m", gguf, "-p", str(plen), "-n", str(olen), "-t", str(threads), "-o", "json", *(extra or [])]
    rc, out, err, _ = _run(cmd)
    try:
        tests = json.loads(out[out.index("["):])
    except ValueError:
        tests = []
    prefill = next((t for t in tests if t.get("n_prompt") == plen and t.get("n_gen") == 0), None)
    decode = next((t for t in tests if t.get("n_gen") == olen and t.get("n_prompt") == 0), None)
    if rc != 0 or prefill is None or decode is None:
        print(f"llama-bench failed (exit {rc}):\n{err[-3000:]}", file=sys.stderr)
        return None
    return {"engine": "llama.cpp", "prompt": plen, "output": olen, "prefill_tok_s": prefill["avg_ts"],
            "prefill_tok_s_stddev": prefill["stddev_ts"], "decode_tok_s": decode["avg_ts"],
            "decode_tok_s_stddev": decode["stddev_ts"], "repetitions": len(decode.get("samples_ts", []))}


def decode_rate(folder: str, gguf: str, output: int, threads: int) -> float:
    """llama-bench's one-stream decode rate of ``output`` tokens from an empty context (mean of 3), tok/s (nan when
    it fails, its error printed)."""
    binary = tool(folder, "llama-bench")
    if binary is None:
        raise FileNotFoundError(f"no llama-bench in {folder}")
    rc, out, err, _ = _run([binary, "-m", gguf, "-p", "0", "-n", str(output), "-t", str(threads), "-r", "3", "-o",
                            "json"])
    tests = json.loads(out[out.index("["):]) if rc == 0 and "[" in out else []
    decode = next((t for t in tests if t.get("n_gen") == output), None)
    if decode is None:
        print(f"llama-bench failed (exit {rc}):\n{err[-2000:]}", file=sys.stderr)
        return float("nan")
    return decode["avg_ts"]
