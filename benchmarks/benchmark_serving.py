"""Load generator for a running ``hybridserve serve`` (or any OpenAI-compatible server).

Sends ``--num-requests`` streaming requests, at most ``--concurrency`` at once, arriving at
``--request-rate`` per second (a Poisson process; ``inf`` sends them all at once), and reports
request and token throughput, time to first token (TTFT), inter-token latency (ITL) and end-to-end
latency percentiles, and the errors by kind.

    hybridserve serve DIR --port 8000 &
    python benchmarks/benchmark_serving.py --url http://127.0.0.1:8000 --num-requests 200 \\
        --concurrency 32 --request-rate 8 --prompt-words 64 --max-tokens 128

This is a tool, not a test: it only measures. Prompts are random words (``--seed``), so runs are
comparable; ``--ignore-eos`` (default on) makes every request generate exactly ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact the of and to in is was for on are with as be at by "
         "this had not but from have they which one you were all she there would their we him been has when "
         "who will more no if out so said what up its about into than them can only other new some could").split()


@dataclass
class Result:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def sse_events(response: httpx.Response):
    """The ``data:`` payloads of a server-sent event stream (split on newline bytes only)."""
    buffer = b""
    async for raw in response.aiter_bytes():
        buffer += raw
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line[len(b"data: "):].rstrip(b"\r").decode()


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: str) -> Result:
    body: dict = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    start = time.perf_counter()
    result = Result(ok=False)
    last = None
    try:
        async with client.stream("POST", args.url.rstrip("/") + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
                return result
            async for data in sse_events(response):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', '')[:60]}"
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
        return result
    result.latency = time.perf_counter() - start
    result.ok = True
    return result


async def run(args: argparse.Namespace) -> list[Result]:
    prompts = make_prompts(args.num_requests, args.prompt_words, args.seed)
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        async def limited(prompt: str) -> Result:
            async with limit:
                return await one_request(client, args, prompt)

        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        return await asyncio.gather(*tasks)


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    ordered = sorted(values)
    out = {f"p{p}": ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))] for p in ps}
    out["mean"] = statistics.fmean(ordered)
    return out


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in ok)) / duration if duration else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itls]),
        "latency_s": percentiles([r.latency for r in ok]),
    }


def print_report(summary: dict) -> None:
    print(f"requests      {summary['completed']}/{summary['requests']} completed in {summary['duration_s']:.2f} s")
    if summary["errors"]:
        print("errors        " + ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()))
    print(f"throughput    {summary['request_throughput']:.2f} req/s, "
          f"{summary['output_token_throughput']:.1f} output tok/s, {summary['total_token_throughput']:.1f} total tok/s")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("latency_s", "latency")):
        p = summary[key]
        print(f"{label:<13} mean {p['mean'] * 1e3:8.1f} ms   p50 {p['p50'] * 1e3:8.1f} ms   "
              f"p90 {p['p90'] * 1e3:8.1f} ms   p99 {p['p99'] * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16, help="most requests in flight at once")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="mean arrivals per second (Poisson); inf sends all at once")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    args = parser.parse_args()
    if args.concurrency < 1 or args.num_requests < 1 or args.request_rate <= 0:
        parser.error("--concurrency, --num-requests and --request-rate must be positive")
    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
        args.model = models["data"][0]["id"]
    start = time.perf_counter()
    results = asyncio.run(run(args))
    summary = summarize(results, time.perf_counter() - start)
    print_report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
