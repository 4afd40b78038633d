"""Hostile-client probes against a live ``hybridserve serve`` on loopback, with ``/health`` polled throughout.

Starts the server (the shipped model unless ``--model``), runs each probe of docs/server.md's Security section
and prints, per probe, what came back and how long it took, then the slowest ``/health`` answer seen while the
probes ran and the server's memory before and after. Loopback only; every loop is bounded in count and time.

    python benchmarks/security_probes.py [--model DIR] [--port 8765] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

HOST = "127.0.0.1"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class HealthPoller(threading.Thread):
    """GET /health every 50 ms until stopped; keeps the slowest answer and counts the failures."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.slowest, self.failures, self.polls = base, 0.0, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = client.get(f"{self.base}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.slowest = max(self.slowest, time.perf_counter() - t0)
                self.failures += not ok
                self.polls += 1
                self.stop.wait(0.05)


def _post(client: httpx.Client, base: str, path: str, body: dict, key: str | None = None) -> tuple[int, str, float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    r = client.post(f"{base}{path}", json=body, headers=headers)
    return r.status_code, r.text[:160], time.perf_counter() - t0


def probe_cache_salt(client, base, model) -> dict:
    """A secret in one salt's prompt; another salt sends the right guess twice: cached_tokens must stay 0 (the
    second send would report the match without salts), while the same salt's sends do hit."""
    story = "Once upon a time there was a small model that served many requests at once. " * 4
    victim = {"model": model, "prompt": story + "The vault code is 4817.", "max_tokens": 1, "cache_salt": "tenant-a"}
    _post(client, base, "/v1/completions", victim)
    cached = []
    for _ in range(2):
        r = client.post(f"{base}/v1/completions", json={**victim, "cache_salt": "tenant-b"})
        cached.append(((r.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    for _ in range(2):  # the same salt: its second send resumes from the branch point its first one planted
        same = client.post(f"{base}/v1/completions", json=victim).json()
    same_cached = ((same.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"other salt cached_tokens": cached, "same salt cached_tokens": same_cached,
            "ok": all(c == 0 for c in cached) and same_cached > 0}


def probe_big_choice(client, base, model) -> dict:
    status, text, seconds = _post(client, base, "/v1/completions", {
        "model": model, "prompt": "x", "max_tokens": 1, "guided_choice": [f"c{i}" for i in range(60_000)]})
    return {"status": status, "seconds": round(seconds, 2), "message": text, "ok": status == 400}


def probe_heavy_regexes(client, base, model, pid) -> dict:
    before = _rss_mib(pid)
    statuses = []
    for i in range(6):
        status, _, _ = _post(client, base, "/v1/completions", {
            "model": model, "prompt": "x", "max_tokens": 1, "guided_regex": f"(b{{{1000 + i}}}){{1000}}"})
        statuses.append(status)
    grown = _rss_mib(pid) - before
    return {"statuses": statuses, "rss_growth_mib": round(grown, 1), "ok": all(s == 400 for s in statuses)}


def probe_huge_response(client, base, model) -> dict:
    status, text, seconds = _post(client, base, "/v1/completions", {
        "model": model, "prompt": [list(range(5, 2005))], "n": 128, "max_tokens": 0, "echo": True, "logprobs": 20})
    return {"status": status, "seconds": round(seconds, 2), "message": text, "ok": status == 400}


def probe_bad_values(client, base, model) -> dict:
    bodies = {"logit_bias 5000 digits": {"logit_bias": {"9" * 5000: 1.0}},
              "repetition_penalty 1e-300": {"repetition_penalty": 1e-300}}
    out = {name: _post(client, base, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1, **b})[0]
           for name, b in bodies.items()}
    return {**out, "ok": all(s == 400 for s in out.values())}


def probe_fair_share(client, base, model) -> dict:
    """A small request sent behind one that asks for n=64 long completions starts promptly."""
    result: dict = {}

    def big() -> None:
        result["big"] = _post(client, base, "/v1/completions", {"model": model, "prompt": "Once", "n": 64,
                                                                "max_tokens": 300, "ignore_eos": True})[0]

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(1.0)
    status, _, seconds = _post(client, base, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 8})
    thread.join(timeout=600)
    return {"small status": status, "small seconds": round(seconds, 2), "big status": result.get("big"),
            "ok": status == 200 and seconds < 5.0}


def probe_trickle(base_port: int) -> dict:
    """100 connections that send their request line a byte every 0.5 s: all closed by the header timeout."""
    socks = []
    for _ in range(100):
        s = socket.create_connection((HOST, base_port), timeout=5)
        s.sendall(b"P")
        socks.append(s)
    deadline = time.monotonic() + 30
    open_count = len(socks)
    while open_count and time.monotonic() < deadline:
        open_count = 0
        for s in socks:
            try:
                s.sendall(b"O")
                s.settimeout(0.01)
                data = s.recv(1024)
                open_count += data != b""
            except socket.timeout:
                open_count += 1
            except OSError:
                pass
        time.sleep(0.5)
    seconds = 30 - max(0.0, deadline - time.monotonic())
    for s in socks:
        s.close()
    return {"still open": open_count, "seconds until all closed": round(seconds, 1), "ok": open_count == 0}


def probe_unauthenticated_body(base_port: int) -> dict:
    """With --api-key: a 2 MiB body without the key gets 401 before it is sent."""
    s = socket.create_connection((HOST, base_port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 2097152\r\n\r\n" + b" " * 65536)
    s.settimeout(5)
    try:
        answer = s.recv(200)
    except socket.timeout:
        answer = b""
    s.close()
    return {"answer": answer.split(b"\r\n")[0].decode(errors="replace"), "ok": answer.startswith(b"HTTP/1.1 401")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    key = "probe-key"
    cmd = [sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", *([a.model] if a.model else []),
           "--port", str(a.port), "--api-key", key, "--header-timeout", "3", "--log-level", "warning"]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://{HOST}:{a.port}"
    results: dict = {}
    try:
        with httpx.Client(timeout=600.0, headers={"Authorization": f"Bearer {key}"}) as client:
            for _ in range(600):
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
            rss0 = _rss_mib(server.pid)
            poller = HealthPoller(base)
            poller.start()
            probes = [("cache_salt oracle", lambda: probe_cache_salt(client, base, model)),
                      ("60k guided_choice", lambda: probe_big_choice(client, base, model)),
                      ("heavy regexes", lambda: probe_heavy_regexes(client, base, model, server.pid)),
                      ("n=128 echo logprobs=20", lambda: probe_huge_response(client, base, model)),
                      ("bad sampling values", lambda: probe_bad_values(client, base, model)),
                      ("small request behind n=64", lambda: probe_fair_share(client, base, model)),
                      ("100 trickling connections", lambda: probe_trickle(a.port)),
                      ("unauthenticated 2 MiB body", lambda: probe_unauthenticated_body(a.port))]
            for name, probe in probes:
                results[name] = probe()
                print(f"{name}: {results[name]}", flush=True)
            poller.stop.set()
            poller.join()
            results["health"] = {"polls": poller.polls, "failures": poller.failures,
                                 "slowest_s": round(poller.slowest, 3)}
            results["rss_mib"] = {"start": round(rss0, 1), "end": round(_rss_mib(server.pid), 1)}
            print(f"/health: {results['health']}; RSS {results['rss_mib']}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
