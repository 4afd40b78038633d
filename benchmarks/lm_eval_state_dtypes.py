"""lm-eval through ``hybridserve serve`` with several ``--mamba-ssm-cache-dtype`` values: accuracy and its
standard error per recurrent-state dtype, on the shipped model by default.

For each state dtype a server is started on a free loopback port (the same model and flags, only the state dtype
differs), lm-eval's ``local-completions`` backend runs the task against it (token-id requests, the checkpoint's
tokenizer), and the server is stopped. Nothing is downloaded: the default task, ``hs_cloze``, is built here
from a text (the one ``hybridserve drift`` scores, or ``--text FILE``): for each sentence, the text before its
last word (``--context-chars`` characters of it, so the recurrent state has run over a few hundred tokens)
with four choices, the true last word and three last words of other sentences, drawn with a fixed seed.
``--tasks NAMES --include-path DIR`` runs other tasks instead (lm-eval's own, where their datasets are at hand).

    python benchmarks/lm_eval_state_dtypes.py --state-dtypes float32,bfloat16 --limit 100
    python benchmarks/lm_eval_state_dtypes.py --model DIR --state-dtypes float32,bfloat16,int8 \\
        --serve-args "--dtype bfloat16"

A loglikelihood task is a prefill: the state is stored in its dtype at the end of each prefill chunk only
(``--max-num-batched-tokens``, 2048 by default, is the most tokens of one step), so
``--serve-args "--max-num-batched-tokens 16"`` rounds it at least every 16 tokens (slower); ``hybridserve drift``
measures the per-token rounding of decoding. Needs ``pip install 'lm-eval[api]'``.

This is a tool, not a test: it only measures (``tests/server/test_lm_eval.py`` checks the server against
lm-eval's ``hf`` backend).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED_NAME = "state-dtype-eval"
TASK = "hs_cloze"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
WORD = re.compile(r"^[A-Za-z]{3,}$")


def cloze_docs(text: str, context_chars: int, seed: int) -> list[dict]:
    """One multiple-choice doc per sentence that ends in a plain word: the text up to that word (its last
    ``context_chars`` characters, from a word boundary) and four choices (the word, three others' last words)."""
    ends: list[tuple[int, str]] = []  # (where the last word starts, the word)
    offset = 0
    for sentence in SENTENCE_END.split(text):
        start = text.index(sentence, offset)
        offset = start + len(sentence)
        words = sentence.rstrip(".!?\"' ").split()
        if len(words) >= 8 and WORD.match(words[-1]):
            ends.append((start + sentence.rstrip(".!?\"' ").rindex(words[-1]), words[-1]))
    vocabulary = sorted({word.lower() for _, word in ends})
    rng = random.Random(seed)
    docs = []
    for where, word in ends:
        context = text[max(0, where - context_chars):where]
        context = context[context.find(" ") + 1:] if where > context_chars else context
        others = rng.sample([w for w in vocabulary if w != word.lower()], 3)
        choices = [word, *others]
        rng.shuffle(choices)
        docs.append({"context": context.rstrip(" "), "choices": [" " + c for c in choices],
                     "label": choices.index(word)})
    return docs


def write_task(folder: str, docs: list[dict]) -> str:
    """The cloze task's YAML and jsonl in ``folder`` (lm-eval's ``include_path``)."""
    data = os.path.join(folder, f"{TASK}.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(os.path.join(folder, f"{TASK}.yaml"), "w", encoding="utf-8") as f:
        f.write(TASK_YAML.format(task=TASK, data=data))
    return folder


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, state_dtype: str, serve_args: list[str], log_path: str,
                 timeout: float) -> tuple[subprocess.Popen, str]:
    """``hybridserve serve`` with ``--mamba-ssm-cache-dtype state_dtype`` on loopback, once ``/health`` answers."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--served-model-name", SERVED_NAME,
           "--mamba-ssm-cache-dtype", state_dtype, *serve_args]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    with open(log_path, "rb") as f:
        tail = f.read().decode(errors="replace")[-3000:]
    raise SystemExit(f"the server did not start ({' '.join(cmd)}):\n{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def evaluate(url: str, tokenizer: str, tasks: list[str], include_path: str | None, limit: int | None) -> dict:
    """lm-eval's results for ``tasks`` against the server at ``url``: {task: (accuracy, its standard error)}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = {"model": SERVED_NAME, "base_url": url + "/v1/completions", "tokenizer": tokenizer,
                  "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                  "max_retries": 1}
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks, batch_size=8,
                                      task_manager=TaskManager(include_path=include_path,
                                                               include_defaults=tasks != [TASK]),
                                      limit=limit, bootstrap_iters=1000, random_seed=0)
    return {task: (row.get("acc,none"), row.get("acc_stderr,none")) for task, row in results["results"].items()}


def number(value: float | None) -> str:
    """A figure for the table: 4 decimals, or n/a when the task has no such metric."""
    return f"{value:7.4f}" if isinstance(value, (int, float)) else f"{'n/a':>7s}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--state-dtypes", default="float32,bfloat16",
                        help="comma-separated --mamba-ssm-cache-dtype values, one server each")
    parser.add_argument("--limit", type=int, default=None, help="docs per task (default: all)")
    parser.add_argument("--tasks", default=TASK, help=f"comma-separated lm-eval tasks (default: {TASK}, built here)")
    parser.add_argument("--include-path", default=None, help="folder of task YAMLs for --tasks")
    parser.add_argument("--text", default=None, help="text the cloze task is built from (default: the drift text)")
    parser.add_argument("--context-chars", type=int, default=1500, help="characters of context per cloze doc")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cloze task's distractors")
    parser.add_argument("--serve-args", default="", help="more `hybridserve serve` flags, one string")
    parser.add_argument("--server-timeout", type=float, default=600, help="seconds a server may take to start")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hybridserve.default_model import default_model_path
    from hybridserve.evaluation.drift import DEFAULT_TEXT

    tokenizer = args.model or default_model_path()
    tasks = [t for t in args.tasks.split(",") if t]
    work = tempfile.mkdtemp(prefix="lm_eval_state_dtypes-")
    include_path = args.include_path
    if tasks == [TASK] and include_path is None:
        text = open(args.text or DEFAULT_TEXT, encoding="utf-8").read()
        docs = cloze_docs(text, args.context_chars, args.seed)
        include_path = write_task(work, docs)
        print(f"{TASK}: {len(docs)} docs from {args.text or 'the drift text'}; --limit {args.limit}", flush=True)
    rows = []
    for state_dtype in [d for d in args.state_dtypes.split(",") if d]:
        started = time.perf_counter()
        proc, url = start_server(args.model, state_dtype, shlex.split(args.serve_args),
                                 os.path.join(work, f"server-{state_dtype}.log"), args.server_timeout)
        try:
            scores = evaluate(url, tokenizer, tasks, include_path, args.limit)
        finally:
            stop_server(proc)
        for task, (acc, stderr) in scores.items():
            rows.append({"state_dtype": state_dtype, "task": task, "acc": acc, "acc_stderr": stderr,
                         "seconds": round(time.perf_counter() - started, 1)})
            print(f"{state_dtype:>10s} {task}: acc {number(acc)} ± {number(stderr)} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"\n{'state dtype':>12s} {'task':16s} {'acc':>7s} {'stderr':>7s}")
    for row in rows:
        print(f"{row['state_dtype']:>12s} {row['task']:16s} {number(row['acc'])} {number(row['acc_stderr'])}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": tokenizer, "limit": args.limit, "serve_args": args.serve_args, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
