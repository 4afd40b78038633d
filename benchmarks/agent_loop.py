"""Multi-turn agent benchmark: time to first token per turn, prefix caching off and on.

An agent loop as a client runs it against the OpenAI-compatible server: each turn asks for a tool call
(``tool_choice="required"``, so every turn calls a tool, even on random weights), then appends the assistant's
call and a tool result of ``--result-chars`` characters as a ``role: "tool"`` message, so the prompt grows by
the call and the result every turn. Two servers run the same conversations, one with
``--no-enable-prefix-caching`` and one with caching on; their requests alternate (off, on, off, on, ...), each
server idle while the other runs, so both see the same machine load. TTFT is the time from sending the
streamed request to its first token (the first chunk after the role chunk); also reported are the time to the
first tool-call delta (the call's name complete: a dozen tokens of the format, forced by the grammar but decoded
one a step) and of the whole turn.

The checkpoint needs a chat template that renders tools: by default the tokenizer of the tests' Qwen-style tool
template (tests/server/tool_checkpoint.py) is written beside the run and passed with ``--tokenizer``, so any
checkpoint of a larger vocabulary works (``benchmarks/make_bench_model.py``'s, say).

    python benchmarks/make_bench_model.py /tmp/bench-granite-100m
    python benchmarks/agent_loop.py --model /tmp/bench-granite-100m --turns 6 --json /tmp/agent.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the documents",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24},
                                                    "top_k": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["query", "top_k"], "additionalProperties": False}}}]
SYSTEM = "You are a research agent. Use the search tool, read its results, and search again until done. " * 4


def tool_result(turn: int, chars: int) -> str:
    """A deterministic tool result of about ``chars`` characters."""
    line = f"result {turn}: the document says that item {turn} relates to the query; "
    return (line * (chars // len(line) + 1))[:chars]


def run_turn(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed turn: ``ttft_s`` (to the first chunk after the role chunk: the first token), ``call_s`` (to the
    first tool-call delta: the call's name is complete), ``total_s``, ``calls`` (as history entries),
    ``cached_tokens`` and ``finish_reason``."""
    start = time.perf_counter()
    ttft = first_call = None
    calls: dict[int, dict] = {}
    cached = 0
    finish = ""
    stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0.0, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            delta = choice.delta
            if ttft is None and delta.role is None:
                ttft = time.perf_counter() - start
            if first_call is None and delta.tool_calls:
                first_call = time.perf_counter() - start
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
                if tc.function.name:
                    entry["function"]["name"] = tc.function.name
                entry["function"]["arguments"] += tc.function.arguments or ""
    total = time.perf_counter() - start
    return {"ttft_s": ttft if ttft is not None else total, "call_s": first_call if first_call is not None else total,
            "total_s": total, "calls": [calls[i] for i in sorted(calls)], "cached_tokens": cached,
            "finish_reason": finish}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory whose chat template renders tools (default: the tests' template)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--result-chars", type=int, default=600, help="characters of each tool result")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1, help="conversations per server")
    parser.add_argument("--cache-memory", default="256MiB")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()

    import openai

    from tests.server.server_utils import ServerProcess
    from tests.server.tool_checkpoint import HERMES_TEMPLATE, tool_tokenizer

    work = tempfile.mkdtemp(prefix="agent-loop-")
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = os.path.join(work, "tokenizer")
        tool_tokenizer(HERMES_TEMPLATE).save_pretrained(tokenizer)
    common = ("--served-model-name", "m", "--cache-memory", args.cache_memory, "--tokenizer", tokenizer,
              "--tool-call-parser", "hermes")
    servers = {"off": ServerProcess(args.model, os.path.join(work, "off.log"), *common, "--no-enable-prefix-caching"),
               "on": ServerProcess(args.model, os.path.join(work, "on.log"), *common)}
    results: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for proc in servers.values():
            proc.wait_healthy(timeout=600)
        clients = {k: openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0, timeout=600)
                   for k, p in servers.items()}
        for repeat in range(args.repeats):
            histories = {k: [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Find what item {repeat} relates to."}] for k in servers}
            for turn in range(args.turns):
                for mode in ("off", "on"):  # interleaved: the two servers take turns
                    out = run_turn(clients[mode], histories[mode], args.max_tokens)
                    calls = out.pop("calls")
                    results[mode].append({"repeat": repeat, "turn": turn, "num_calls": len(calls), **out})
                    result = tool_result(turn, args.result_chars)
                    if out["finish_reason"] == "tool_calls":
                        histories[mode].append({"role": "assistant", "content": None, "tool_calls": calls})
                        histories[mode] += [{"role": "tool", "tool_call_id": c["id"], "content": result}
                                            for c in calls]
                    else:  # cut by --max-tokens: the call is incomplete, so the result comes as a user turn
                        histories[mode] += [{"role": "assistant", "content": "(cut)"},
                                            {"role": "user", "content": result}]
    finally:
        for proc in servers.values():
            proc.stop()

    print(f"CPU: {platform.processor() or platform.machine()}; model {args.model}; {args.turns} turns, tool results "
          f"of {args.result_chars} chars, {args.max_tokens} max tokens a turn")
    print("turn | TTFT ms off / on (x) | first call delta ms off / on | turn ms off / on | cached (on) | finish")
    for off, on in zip(results["off"], results["on"]):
        print(f"{off['turn']:>4} | {off['ttft_s'] * 1e3:.0f} / {on['ttft_s'] * 1e3:.0f} "
              f"({off['ttft_s'] / on['ttft_s']:.2f}x) | {off['call_s'] * 1e3:.0f} / {on['call_s'] * 1e3:.0f} | "
              f"{off['total_s'] * 1e3:.0f} / {on['total_s'] * 1e3:.0f} | {on['cached_tokens']} | "
              f"{off['finish_reason']}, {on['finish_reason']}")
    totals = {k: sum(r["total_s"] for r in v) for k, v in results.items()}
    print(f"total: off {totals['off']:.2f} s, on {totals['on']:.2f} s ({totals['off'] / totals['on']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": platform.processor(), "results": results, "totals_s": totals}, f,
                      indent=1)


if __name__ == "__main__":
    main()
