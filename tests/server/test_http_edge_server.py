"""The HTTP edge of ``hybridserve serve`` itself: one server on loopback (a tiny Bamba) with an API key,
deadlines of half a second, a small log budget, and a file descriptor limit of 100 (``ulimit -n``), so
that its connection limit is derived from it.
"""

from __future__ import annotations

import select
import time

import pytest

from tests.server.edge_server import closed_after, connect, read_response, request_head
from tests.server.server_utils import ServerProcess, make_checkpoint

KEY = "edge-key"
SHORT = 0.5
OPEN_FILES = 100
LOG_LINES = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge")
    ckpt = make_checkpoint(str(root / "bamba-edge"))
    proc = ServerProcess(ckpt, str(root / "server.log"), "--header-timeout", str(SHORT), "--body-timeout", str(SHORT),
                         "--keep-alive-timeout", "30", "--max-log-lines-per-minute", str(LOG_LINES),
                         "--max-num-seqs", "2", "--cache-memory", "16MiB", api_key=KEY, open_files=OPEN_FILES)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def test_unauthenticated_2mib_body_gets_401_before_it_is_sent(server):
    sock = connect(server.port)
    sock.sendall(request_head("POST", "/v1/completions", f"Content-Length: {2 * 2 ** 20}\r\n"
                                                         "Content-Type: application/json\r\n"))
    sock.sendall(b'{"prompt": "' + b"x" * 65536)  # the rest is never sent
    answer = read_response(sock, timeout=5.0)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer, answer[:300]


def test_trickling_headers_and_bodies_are_cut_off(server):
    sock = connect(server.port)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    took, received = closed_after(sock, b"X-Slow: aaaaaaaaaaaaaaaa\r\n", limit_s=6.0)
    assert took <= SHORT + 3.0 and received.startswith(b"HTTP/1.1 408"), (took, received[:300])
    sock = connect(server.port)
    sock.sendall(request_head("POST", "/v1/completions", f"Authorization: Bearer {KEY}\r\nContent-Length: 5000\r\n"))
    took, received = closed_after(sock, b'{"prompt": "', limit_s=6.0)
    assert took <= SHORT + 3.0 and received.startswith(b"HTTP/1.1 408"), (took, received[:300])
    assert b"--body-timeout" in received


def test_invalid_requests_write_a_bounded_log(server):
    for _ in range(15):
        sock = connect(server.port)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 400")
        sock.close()
    assert server.log().count("Invalid HTTP request received") == LOG_LINES


def test_a_connection_flood_under_a_low_ulimit_is_refused_quickly(server):
    kept = connect(server.port)  # a client kept alive from before the flood
    kept.sendall(request_head("GET", "/health"))
    assert read_response(kept).startswith(b"HTTP/1.1 200")
    flood = []
    try:
        for _ in range(OPEN_FILES):  # more connections than the server has descriptors, at once
            sock = connect(server.port)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            flood.append(sock)
        answered, deadline = set(), time.monotonic() + SHORT * 0.8  # before the head deadline: the refused ones
        while time.monotonic() < deadline:
            answered.update(select.select(flood, [], [], 0.05)[0])
        answers = [read_response(sock, timeout=2.0) for sock in answered]
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503") and b"--max-connections" in a]
        # the limit keeps descriptors free (FD_RESERVE): many of the flood are refused, at once (those that found
        # no descriptor at all wait in the listen queue: asyncio retries accepting a second later)
        assert len(refused) == len(answers) >= OPEN_FILES // 4, (len(refused), [a[:100] for a in answers[:3]])
        start = time.monotonic()
        kept.sendall(request_head("GET", "/health"))  # the client already connected is still served
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        assert time.monotonic() - start < 2.0
    finally:
        for sock in flood:
            sock.close()
    for _ in range(40):  # the flood gone, new connections are served again
        sock = connect(server.port)
        sock.sendall(request_head("GET", "/health"))
        answer = read_response(sock)
        sock.close()
        if answer.startswith(b"HTTP/1.1 200"):
            break
        time.sleep(0.1)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert server.log().count("refused a connection") <= LOG_LINES
