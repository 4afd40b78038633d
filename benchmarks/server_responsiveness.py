"""Does one huge request stall the others? A stream's inter-token gap and ``/health`` latency, with and
without another client sending a huge prompt at the same time.

Each round runs one streaming completion while ``/health`` is polled; in the "huge" rounds, once the
stream has its first token, a second client sends a ``--huge-mib`` MiB prompt (with a Content-Length),
the same body chunked (no Content-Length), and a prompt just under the body limit but too long to fit
(``--fit-chars`` characters; the server refuses it by its length, without tokenizing it).

    python benchmarks/server_responsiveness.py                  # starts `hybridserve serve` (shipped model)
    python benchmarks/server_responsiveness.py --url http://127.0.0.1:8000 --api-key KEY

This is a tool, not a test: it only measures (tests/server/test_bad_requests.py asserts a loose bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Round:
    gaps: list[float] = field(default_factory=list)  # seconds between the stream's chunks
    health: list[float] = field(default_factory=list)  # seconds per /health answer
    huge: list[tuple[str, int, float]] = field(default_factory=list)  # (what, status, seconds to the answer)


async def stream(client: httpx.AsyncClient, args: argparse.Namespace, out: Round, first: asyncio.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                out.gaps.append(now - last)
            last = now
            first.set()


async def poll_health(client: httpx.AsyncClient, out: Round, done: asyncio.Event) -> None:
    while not done.is_set():
        start = time.perf_counter()
        (await client.get("/health")).raise_for_status()
        out.health.append(time.perf_counter() - start)
        await asyncio.sleep(0.01)


def huge_bodies(args: argparse.Namespace) -> tuple[bytes, bytes]:
    """The huge prompt's body and the too-long one's (built once, outside the measured rounds)."""
    big = json.dumps({"prompt": "Hello world " * (args.huge_mib * 2 ** 20 // 12), "max_tokens": 4}).encode()
    return big, json.dumps({"prompt": "x" * args.fit_chars, "max_tokens": 4}).encode()


async def send_huge(client: httpx.AsyncClient, args: argparse.Namespace, out: Round) -> None:
    big, fit = args.bodies

    async def chunked():
        for i in range(0, len(big), 2 ** 16):
            yield big[i:i + 2 ** 16]

    headers = {"Content-Type": "application/json"}
    for what, content in ((f"{args.huge_mib} MiB prompt", big), (f"{args.huge_mib} MiB chunked", chunked()),
                          (f"{args.fit_chars:,}-char prompt", fit)):
        start = time.perf_counter()
        try:
            status = (await client.post("/v1/completions", content=content, headers=headers)).status_code
        except httpx.TransportError:
            status = -1  # the server closed the connection before answering
        out.huge.append((what, status, time.perf_counter() - start))


async def one_round(args: argparse.Namespace, huge: bool) -> Round:
    out, first, done = Round(), asyncio.Event(), asyncio.Event()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client, \
            httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as other:
        streaming = asyncio.create_task(stream(client, args, out, first))
        health = asyncio.create_task(poll_health(other, out, done))
        await first.wait()
        if huge:
            await send_huge(other, args, out)
        await streaming
        done.set()
        await health
    return out


def summary(name: str, rounds: list[Round]) -> None:
    gaps = [g for r in rounds for g in r.gaps]
    health = [h for r in rounds for h in r.health]
    print(f"{name:>8}: stream gap max {max(gaps) * 1e3:8.1f} ms  median {statistics.median(gaps) * 1e3:6.2f} ms | "
          f"/health max {max(health) * 1e3:8.1f} ms  median {statistics.median(health) * 1e3:6.2f} ms "
          f"({len(health)} probes)")
    for what, status, seconds in (h for r in rounds for h in r.huge):
        print(f"{'':>10}{what}: HTTP {status} in {seconds * 1e3:.0f} ms")


def start_server(args: argparse.Namespace) -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.url = f"http://127.0.0.1:{port}"
    model = [args.model] if args.model else []
    cmd = [sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", *model, "--port", str(port),
           "--log-level", "warning", *args.serve_args]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(args.url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start: {' '.join(cmd)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="checkpoint to serve when starting one (default: shipped)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="further `hybridserve serve` flags when starting one (last on the line)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens of the measured stream")
    parser.add_argument("--huge-mib", type=int, default=10)
    parser.add_argument("--fit-chars", type=int, default=1_500_000,
                        help="characters of the too-long prompt (keep it under the body limit)")
    args = parser.parse_args()
    args.bodies = huge_bodies(args)
    proc = start_server(args) if args.url is None else None
    try:
        asyncio.run(one_round(args, huge=False))  # warm-up
        for name, huge in (("alone", False), ("huge", True)):
            summary(name, [asyncio.run(one_round(args, huge)) for _ in range(args.rounds)])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
