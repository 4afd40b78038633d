"""A uvicorn server with hybridserve's HTTP edge in a thread of the test process, on loopback, with a
small ASGI app (no model): ``GET /health``, and ``POST /echo`` that reads the whole body and answers
its length. Raw-socket helpers to talk to it byte by byte."""

from __future__ import annotations

import json
import socket
import threading
import time

import uvicorn

from hybridserve.entrypoints.openai.early_auth import EarlyAuth
from hybridserve.entrypoints.openai.edge_limits import EdgeLimits
from hybridserve.entrypoints.openai.http_edge import edge_protocol
from tests.server.server_utils import free_port


async def small_app(scope, receive, send) -> None:
    """/health answers at once; /echo reads its whole body first (like the body size limit does)."""
    if scope["type"] != "http":
        return
    size = 0
    if scope["path"] == "/echo":
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
    body = json.dumps({"status": "ok", "bytes": size}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class EdgeServer:
    """``with EdgeServer(EdgeLimits(...)) as server``: serving on ``server.port`` until the block ends."""

    def __init__(self, edge: EdgeLimits, api_key: str | None = None) -> None:
        self.port = free_port()
        config = uvicorn.Config(EarlyAuth(small_app, api_key), host="127.0.0.1", port=self.port, lifespan="off",
                                log_config=None, http=edge_protocol(edge), timeout_keep_alive=edge.keep_alive_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> EdgeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the edge server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def connect(self) -> socket.socket:
        return connect(self.port)


def connect(port: int) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port``, with a small receive buffer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    return sock


def request_head(method: str, path: str, extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()


def read_response(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """One response (b"" if the server closes first; without a content-length, all until it closes)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lengths = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")]
        length = lengths[0] if lengths else 2 ** 30  # none: the body ends when the server closes
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n" + body
    except ConnectionResetError:
        return data


def closed_after(sock: socket.socket, trickle: bytes | None, limit_s: float) -> tuple[float, bytes]:
    """Send ``trickle`` one byte every 50 ms (or nothing) until the server closes the connection; (seconds
    it took, what the server sent). AssertionError if it is still open after ``limit_s``."""
    start = time.monotonic()
    received = b""
    sock.settimeout(0.05)
    for i in range(int(limit_s / 0.05) + 1):
        try:
            if trickle is not None:
                sock.send(trickle[i % len(trickle):i % len(trickle) + 1])
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start, received
        if not chunk:
            return time.monotonic() - start, received
        received += chunk
    raise AssertionError(f"the connection is still open after {limit_s} s (received {received[:200]!r})")
