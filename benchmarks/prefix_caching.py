"""Prefix caching benchmark: time to first token and throughput with prefix caching on and off.

Two engines on the same checkpoint, one with ``enable_prefix_caching=True`` and one without, are
built once and run interleaved (off, on, off, on, ... for ``--repeats`` rounds; the ON engine's cache
is reset before each of its runs, so every repeat starts cold). Prompts are random token ids drawn
with a fixed seed (no tokenizer); greedy decoding, EOS ignored. Scenarios:

* ``system``: one shared system prompt (300 tokens) + a distinct 24-token question per request
  (64 requests, 16 generated tokens each), run in two modes:
  ``sequential``: one request at a time, alone in the engine (add request i, step until its first
  token, which gives its TTFT, then until it finishes; then add request i + 1); ``concurrent``: all
  added at once and stepped to completion (TTFT from the common start; throughput).
  ``waves`` (opt-in) adds request i + 1 as soon as request i has its first token, so it shares its
  steps with the decodes of those still running.
* ``chat``: multi-turn chat (8 turns; turn k's prompt = turn k-1's prompt + its generated tokens +
  20 new user tokens; the first turn 100 tokens; 24 generated tokens a turn), one turn at a time:
  per-turn TTFT and ``num_cached_tokens`` on vs off.
* ``short``: a short shared prefix (40 tokens) + distinct 8-16 token suffixes (32 requests),
  sequential: hit rate (sum of ``num_cached_tokens`` / sum of prompt tokens) and TTFT on vs off.

TTFT is the time from ``add_request`` to the end of the step that returned the request's first
output token; throughput is generated tokens / wall time of the run. Prints a table per scenario
(and the CPU model and ISA level); ``--json PATH`` writes every figure (per request too).

    python benchmarks/prefix_caching.py --model /tmp/bench-granite-100m
    python benchmarks/prefix_caching.py --scenario short --requests 8 --repeats 1 --json /tmp/pc.json
    python benchmarks/prefix_caching.py --scenario system --concurrent       # the concurrent mode only

The prompt builders here import nothing but the standard library, so prefix_caching_vllm.py (run in
the vLLM venv) draws exactly the same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter

SCENARIOS = ("system", "chat", "short")
SYSTEM_MODES = ("sequential", "concurrent", "waves")
MIN_TOKEN_ID = 3  # below: pad / bos / eos of the Granite checkpoints


# ----------------------------------------------------------------------------- prompts (stdlib only)
def _draw(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(n)]


def system_prompts(n: int, vocab: int, seed: int, system_len: int = 300, question_len: int = 24) -> list[list[int]]:
    """``n`` prompts: one shared ``system_len``-token prefix + a distinct ``question_len``-token question each."""
    rng = random.Random(f"system-{seed}")
    shared = _draw(rng, system_len, vocab)
    return [shared + _draw(rng, question_len, vocab) for _ in range(n)]


def short_prompts(n: int, vocab: int, seed: int, prefix_len: int = 40, suffix_min: int = 8,
                  suffix_max: int = 16) -> list[list[int]]:
    """``n`` prompts: one shared ``prefix_len``-token prefix + a distinct suffix of ``suffix_min`` to
    ``suffix_max`` tokens each."""
    rng = random.Random(f"short-{seed}")
    shared = _draw(rng, prefix_len, vocab)
    return [shared + _draw(rng, rng.randint(suffix_min, suffix_max), vocab) for _ in range(n)]


def chat_conversations(n: int, vocab: int, seed: int, turns: int = 8, first_len: int = 100,
                       user_len: int = 20) -> list[tuple[list[int], list[list[int]]]]:
    """``n`` conversations: (first-turn prompt, the new user tokens of turns 2..``turns``)."""
    rng = random.Random(f"chat-{seed}")
    return [(_draw(rng, first_len, vocab), [_draw(rng, user_len, vocab) for _ in range(turns - 1)])
            for _ in range(n)]


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def cpu_model_name() -> str:
    """The "model name" of /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(ttfts: list[float], prompt_lens: list[int], cached: list[int], generated: int,
              wall: float) -> dict:
    """The figures of one run: TTFT mean/p50/p90 (s), throughput, hit rate and the cached-token counts."""
    return {"requests": len(ttfts), "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall if wall else 0.0,
            "prompt_tokens": sum(prompt_lens), "cached_tokens": sum(cached),
            "hit_rate": sum(cached) / sum(prompt_lens) if prompt_lens else 0.0,
            "cached_tokens_counts": {str(k): v for k, v in sorted(Counter(cached).items())}}


# ----------------------------------------------------------------------------- the hybridserve runs
class Tracker:
    """Per-request add time, first-token time, tokens and ``num_cached_tokens``, fed by engine steps."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.added: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.finished: set[str] = set()

    def add(self, rid: str, ids: list[int], params) -> None:
        self.added[rid] = time.perf_counter()
        self.engine.add_request(rid, ids, params)

    def step(self) -> None:
        outs = self.engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            toks = out.outputs[0].token_ids
            if toks and rid not in self.ttft:
                self.ttft[rid] = now - self.added[rid]
            self.tokens[rid] = list(toks)
            self.cached[rid] = out.num_cached_tokens
            if out.finished:
                self.finished.add(rid)

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def until_first_token(self, rid: str) -> None:
        while rid not in self.ttft and rid not in self.finished:
            self.step()


def run_requests(engine, prompts: list[list[int]], max_tokens: int, mode: str) -> dict:
    """One run of ``prompts`` in ``mode`` (sequential, waves or concurrent); its summary, per-request figures
    and the prefix-cache counters it moved."""
    from hybridserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    before = engine.prefix_cache_stats()
    tr = Tracker(engine)
    rids = [f"r{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    if mode == "concurrent":
        for rid, ids in zip(rids, prompts):
            tr.add(rid, ids, params)
        tr.drain()
    else:
        for rid, ids in zip(rids, prompts):
            tr.add(rid, ids, params)
            tr.until_first_token(rid)
            if mode == "sequential":
                tr.drain()
        tr.drain()
    wall = time.perf_counter() - start
    after = engine.prefix_cache_stats()
    ttfts = [tr.ttft[r] for r in rids]
    cached = [tr.cached.get(r, 0) for r in rids]
    result = summarize(ttfts, [len(p) for p in prompts], cached, sum(len(tr.tokens[r]) for r in rids), wall)
    result.update({"mode": mode, "ttft_s": ttfts, "num_cached_tokens": cached,
                   "prefix_stats": _stats_delta(before, after)})
    result["tokens"] = [tr.tokens[r] for r in rids]
    return result


def run_chat(engine, conversations, max_tokens: int) -> dict:
    """Each conversation turn by turn (one request at a time): per-turn TTFT, prompt length and cached tokens."""
    from hybridserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    before = engine.prefix_cache_stats()
    tr = Tracker(engine)
    turns = []  # turns[c][k] = {...}
    all_ttft, all_len, all_cached, generated = [], [], [], 0
    start = time.perf_counter()
    for c, (first, users) in enumerate(conversations):
        prompt = list(first)
        conv = []
        for k in range(len(users) + 1):
            rid = f"c{c}t{k}"
            tr.add(rid, prompt, params)
            tr.drain()
            out = tr.tokens[rid]
            conv.append({"prompt_len": len(prompt), "ttft_s": tr.ttft[rid], "num_cached_tokens": tr.cached[rid],
                         # what a cache could give: the previous turn's prompt and all its generated tokens
                         # but the last (sampled, never run through the model)
                         "reusable_tokens": (conv[-1]["prompt_len"] + len(conv[-1]["tokens"]) - 1) if conv else 0,
                         "tokens": out})
            all_ttft.append(tr.ttft[rid])
            all_len.append(len(prompt))
            all_cached.append(tr.cached[rid])
            generated += len(out)
            if k < len(users):
                prompt = prompt + out + users[k]
        turns.append(conv)
    wall = time.perf_counter() - start
    result = summarize(all_ttft, all_len, all_cached, generated, wall)
    n_turns = len(turns[0])
    result["per_turn"] = [{"turn": k + 1,
                           "prompt_len": statistics.fmean(conv[k]["prompt_len"] for conv in turns),
                           "ttft_mean_s": statistics.fmean(conv[k]["ttft_s"] for conv in turns),
                           "num_cached_tokens_mean": statistics.fmean(conv[k]["num_cached_tokens"] for conv in turns),
                           "reusable_tokens_mean": statistics.fmean(conv[k]["reusable_tokens"] for conv in turns)}
                          for k in range(n_turns)]
    result.update({"mode": "chat", "conversations": [[{k: v for k, v in t.items() if k != "tokens"} for t in conv]
                                                      for conv in turns],
                   "prefix_stats": _stats_delta(before, engine.prefix_cache_stats())})
    result["tokens"] = [t["tokens"] for conv in turns for t in conv]
    return result


def _stats_delta(before: dict, after: dict) -> dict:
    """Counters as moved by the run; sizes (snapshots, snapshot_bytes, cached_pages) as at its end."""
    sizes = ("snapshots", "snapshot_bytes", "cached_pages")
    return {k: (v if k in sizes else v - before.get(k, 0)) for k, v in after.items()}


def build_engines(a: argparse.Namespace, max_requests: int) -> dict:
    from hybridserve import LLM

    engines = {}
    for label, on in (("off", False), ("on", True)):
        t0 = time.perf_counter()
        llm = LLM(a.model, enable_prefix_caching=on, cache_memory=a.cache_memory, enable_progress_bar=False,
                  max_num_seqs=max(max_requests, 1), max_num_batched_tokens=a.max_num_batched_tokens,
                  max_model_len=a.max_model_len, dtype=a.dtype)
        print(f"engine caching {label}: loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        engines[label] = llm.engine
    return engines


def warm_up(engine, vocab: int) -> None:
    """A few untimed requests (a lone one, then a small batch) so first-use costs stay out of the figures."""
    from hybridserve import SamplingParams

    rng = random.Random("warm-up")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    engine.add_request("warm-0", _draw(rng, 64, vocab), params)
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(4):
        engine.add_request(f"warm-{i + 1}", _draw(rng, 32, vocab), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def interleaved(engines: dict, repeats: int, run) -> list[dict]:
    """``run(engine)`` for off, on, off, on, ... (the ON cache reset first each time); each run's result,
    labelled, with how many requests' greedy tokens equal those of the OFF run of the same repeat."""
    runs = []
    for rep in range(repeats):
        ref = None
        for label in ("off", "on"):
            engine = engines[label]
            if label == "on":
                engine.reset_prefix_cache()
            r = run(engine)
            r.update({"caching": label, "repeat": rep})
            if label == "off":
                ref = r["tokens"]
            r["identical_to_off"] = sum(x == y for x, y in zip(r["tokens"], ref))
            runs.append(r)
    for r in runs:
        r.pop("tokens")
    return runs


def ratios(runs: list[dict]) -> dict:
    """Per repeat: mean TTFT off / on and throughput on / off; their medians over the repeats."""
    by = {(r["repeat"], r["caching"]): r for r in runs}
    reps = sorted({r["repeat"] for r in runs})
    ttft = [by[rep, "off"]["ttft_mean_s"] / by[rep, "on"]["ttft_mean_s"] for rep in reps]
    tput = [by[rep, "on"]["tokens_per_s"] / by[rep, "off"]["tokens_per_s"] for rep in reps]
    return {"ttft_mean_off_over_on": ttft, "ttft_mean_off_over_on_median": statistics.median(ttft),
            "tokens_per_s_on_over_off": tput, "tokens_per_s_on_over_off_median": statistics.median(tput)}


# ----------------------------------------------------------------------------- output
def _counts(c: dict) -> str:
    return " ".join(f"{k}x{v}" for k, v in c.items())


def print_runs(title: str, runs: list[dict], ratio: dict) -> None:
    print(f"\n== {title} ==")
    print(f"{'mode':<11}{'cache':<6}{'rep':>4}{'TTFT mean ms':>13}{'p50 ms':>9}{'p90 ms':>9}{'tok/s':>8}"
          f"{'wall s':>8}{'hit rate':>9}{'=OFF':>7}  num_cached_tokens (value x requests)")
    for r in runs:
        print(f"{r['mode']:<11}{r['caching']:<6}{r['repeat']:>4}{1e3 * r['ttft_mean_s']:>13.1f}"
              f"{1e3 * r['ttft_p50_s']:>9.1f}{1e3 * r['ttft_p90_s']:>9.1f}{r['tokens_per_s']:>8.1f}{r['wall_s']:>8.2f}"
              f"{r['hit_rate']:>9.3f}{r['identical_to_off']:>4}/{r['requests']:<3}{_counts(r['cached_tokens_counts'])}")
    on = [r for r in runs if r["caching"] == "on"]
    ps = on[-1]["prefix_stats"]
    print(f"  mean TTFT off/on: {' '.join(f'{x:.2f}x' for x in ratio['ttft_mean_off_over_on'])} "
          f"(median {ratio['ttft_mean_off_over_on_median']:.2f}x); tok/s on/off: "
          f"{' '.join(f'{x:.2f}x' for x in ratio['tokens_per_s_on_over_off'])} "
          f"(median {ratio['tokens_per_s_on_over_off_median']:.2f}x)")
    print(f"  ON engine's prefix_cache_stats over its last run: queries {ps['queries']}, hits {ps['hits']} "
          f"({ps['hits'] / max(ps['queries'], 1):.3f}), kv_beyond_snapshot {ps['kv_beyond_snapshot']}, "
          f"snapshots taken {ps['snapshots_taken']} skipped {ps['snapshots_skipped']}, now held: "
          f"{ps['snapshots']} snapshots ({ps['snapshot_bytes'] / 2**20:.1f} MiB), {ps['cached_pages']} pages")


def print_chat(runs: list[dict]) -> None:
    reps = sorted({r["repeat"] for r in runs})
    by = {(r["repeat"], r["caching"]): r for r in runs}
    head = "".join(f"{f'off ms r{rep}':>11}{f'on ms r{rep}':>10}{'off/on':>8}" for rep in reps)
    print(f"{'turn':>5}{'prompt':>8}{head}{'cached on':>11}{'cached off':>11}{'reusable':>10}")
    for k, turn in enumerate(by[reps[0], "on"]["per_turn"]):
        cells = ""
        for rep in reps:
            off, on = by[rep, "off"]["per_turn"][k]["ttft_mean_s"], by[rep, "on"]["per_turn"][k]["ttft_mean_s"]
            cells += f"{1e3 * off:>11.1f}{1e3 * on:>10.1f}{off / on:>7.2f}x"
        off_cached = by[reps[0], "off"]["per_turn"][k]["num_cached_tokens_mean"]
        print(f"{turn['turn']:>5}{turn['prompt_len']:>8.0f}{cells}{turn['num_cached_tokens_mean']:>11.1f}"
              f"{off_cached:>11.1f}{turn['reusable_tokens_mean']:>10.1f}")


def machine(threads: int) -> dict:
    import torch

    from hybridserve.kernels import isa

    return {"cpu": cpu_model_name(), "isa_level": isa.level_in_force(), "cores": os.cpu_count(),
            "threads": threads, "torch": torch.__version__, "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "loadavg_start": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/bench-granite-100m", help="checkpoint directory")
    parser.add_argument("--scenario", default="all", choices=("all", *SCENARIOS))
    parser.add_argument("--requests", type=int, default=None,
                        help="requests of system (default 64) and short (default 32)")
    parser.add_argument("--conversations", type=int, default=2, help="chat: conversations (each of --turns turns)")
    parser.add_argument("--turns", type=int, default=8, help="chat: turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=16, help="system and short: generated tokens per request")
    parser.add_argument("--chat-max-tokens", type=int, default=24, help="chat: generated tokens per turn")
    parser.add_argument("--system-modes", default="sequential,concurrent",
                        help=f"comma-separated subset of {','.join(SYSTEM_MODES)} for the system scenario")
    parser.add_argument("--concurrent", action="store_true", help="system scenario: the concurrent mode only")
    parser.add_argument("--repeats", type=int, default=2, help="off/on rounds per scenario and mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--cache-memory", default="2GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure to this file")
    a = parser.parse_args()
    modes = ["concurrent"] if a.concurrent else [m.strip() for m in a.system_modes.split(",") if m.strip()]
    if set(modes) - set(SYSTEM_MODES):
        parser.error(f"--system-modes: choose from {', '.join(SYSTEM_MODES)}")
    scenarios = SCENARIOS if a.scenario == "all" else (a.scenario,)
    n_system, n_short = a.requests or 64, a.requests or 32

    import torch

    torch.set_num_threads(a.threads)
    vocab = vocab_size(a.model)
    info = machine(a.threads)
    engines = build_engines(a, max(n_system, n_short))
    for engine in engines.values():
        warm_up(engine, vocab)
    print(f"CPU: {info['cpu']} | ISA level: {info['isa_level']} | {a.threads} threads of {info['cores']} cores | "
          f"torch {info['torch']} | load average {' '.join(f'{x:.2f}' for x in info['loadavg_start'])}")
    print(f"model {a.model}; dtype {a.dtype}; {a.repeats} repeats, caching off/on interleaved (ON cache reset "
          f"before each ON run); TTFT = add_request -> end of the step returning the first token")
    results: dict = {"machine": info, "args": vars(a), "scenarios": {}}
    t_all = time.perf_counter()
    if "system" in scenarios:
        prompts = system_prompts(n_system, vocab, a.seed)
        out = {}
        for mode in modes:
            runs = interleaved(engines, a.repeats, lambda e, m=mode: run_requests(e, prompts, a.max_tokens, m))
            out[mode] = {"runs": runs, "ratios": ratios(runs)}
            print_runs(f"system, {mode}: 300-token shared prefix + 24-token question, {n_system} requests, "
                       f"max_tokens {a.max_tokens}", runs, out[mode]["ratios"])
        results["scenarios"]["system"] = out
    if "chat" in scenarios:
        convs = chat_conversations(a.conversations, vocab, a.seed, a.turns)
        runs = interleaved(engines, a.repeats, lambda e: run_chat(e, convs, a.chat_max_tokens))
        ratio = ratios(runs)
        results["scenarios"]["chat"] = {"chat": {"runs": runs, "ratios": ratio}}
        print_runs(f"chat: {a.conversations} conversations x {a.turns} turns (100-token first turn, +20 user "
                   f"tokens a turn), max_tokens {a.chat_max_tokens}", runs, ratio)
        print_chat(runs)
    if "short" in scenarios:
        prompts = short_prompts(n_short, vocab, a.seed)
        runs = interleaved(engines, a.repeats, lambda e: run_requests(e, prompts, a.max_tokens, "sequential"))
        ratio = ratios(runs)
        results["scenarios"]["short"] = {"sequential": {"runs": runs, "ratios": ratio}}
        print_runs(f"short, sequential: 40-token shared prefix + 8-16 token suffix, {n_short} requests, "
                   f"max_tokens {a.max_tokens}", runs, ratio)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - t_all
    print(f"\ntimed part: {results['seconds']:.0f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in results['machine']['loadavg_end'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
