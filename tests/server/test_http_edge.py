"""The HTTP edge (no model): deadlines on a request's head and body, idle kept-alive connections closed,
the connection limit, the API key checked before the body is read, and the log rate limit.

Each test runs a uvicorn server with the edge in a thread (tests/server/edge_server.py), on loopback,
with deadlines of a fraction of a second; every loop is bounded in count and time.
"""

from __future__ import annotations

import io
import logging
import time

import pytest

from hybridserve.entrypoints.openai.edge_limits import EdgeLimits, check_max_connections
from hybridserve.entrypoints.openai.log_limit import LogRateLimit
from tests.server.edge_server import EdgeServer, closed_after, read_response, request_head

SHORT = 0.5  # the deadlines under test, in seconds
LONG = 30.0  # the deadlines a test does not exercise
KEY = "edge-key"


def test_trickling_headers_are_cut_off_at_the_header_timeout():
    with EdgeServer(EdgeLimits(header_timeout=SHORT, body_timeout=LONG, keep_alive_timeout=LONG)) as server:
        sock = server.connect()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        took, received = closed_after(sock, b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n", limit_s=6.0)
        assert SHORT * 0.8 <= took <= SHORT + 3.0, took
        assert received.startswith(b"HTTP/1.1 408") and b"--header-timeout" in received, received[:300]
        kept = server.connect()  # the same on a kept-alive connection's second request
        kept.sendall(request_head("GET", "/health"))
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        took, received = closed_after(kept, b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n", limit_s=6.0)
        assert SHORT * 0.8 <= took <= SHORT + 3.0, took
        assert received.startswith(b"HTTP/1.1 408"), received[:300]


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout():
    with EdgeServer(EdgeLimits(header_timeout=SHORT, body_timeout=LONG, keep_alive_timeout=LONG)) as server:
        took, received = closed_after(server.connect(), None, limit_s=6.0)
        assert SHORT * 0.8 <= took <= SHORT + 3.0 and received == b"", (took, received)  # nothing asked, no answer


def test_a_trickling_body_is_cut_off_at_the_body_timeout():
    with EdgeServer(EdgeLimits(header_timeout=LONG, body_timeout=SHORT, keep_alive_timeout=LONG)) as server:
        sock = server.connect()
        sock.sendall(request_head("POST", "/echo", "Content-Length: 100000\r\n"))
        took, received = closed_after(sock, b"x", limit_s=6.0)
        assert SHORT * 0.8 <= took <= SHORT + 3.0, took
        assert received.startswith(b"HTTP/1.1 408") and b"--body-timeout" in received, received[:300]
        # a body sent at once is still read whole
        fast = server.connect()
        fast.sendall(request_head("POST", "/echo", "Content-Length: 300000\r\n") + b"y" * 300000)
        assert b'"bytes": 300000' in read_response(fast)


def test_an_idle_kept_alive_connection_is_closed():
    with EdgeServer(EdgeLimits(header_timeout=LONG, body_timeout=LONG, keep_alive_timeout=SHORT)) as server:
        sock = server.connect()
        for _ in range(2):  # kept alive between requests sent at once
            sock.sendall(request_head("GET", "/health"))
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        took, received = closed_after(sock, None, limit_s=6.0)
        assert SHORT * 0.8 <= took <= SHORT + 3.0 and received == b"", (took, received)


def test_past_the_connection_limit_new_connections_get_503_while_open_ones_go_on():
    edge = EdgeLimits(header_timeout=LONG, body_timeout=LONG, keep_alive_timeout=LONG, max_connections=4)
    with EdgeServer(edge) as server:
        kept = server.connect()  # a client's kept-alive connection, opened before the flood
        kept.sendall(request_head("GET", "/health"))
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        slow = [server.connect() for _ in range(3)]  # trickling clients take the rest of the limit
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(0.2)
        for _ in range(5):
            start = time.monotonic()
            extra = server.connect()
            extra.sendall(request_head("GET", "/health"))
            answer = read_response(extra, timeout=3.0)
            assert time.monotonic() - start < 2.0
            assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer, answer[:300]
            extra.close()
        kept.sendall(request_head("GET", "/health"))  # the open connection is still served
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        slow.pop().close()  # one leaves: a new connection gets in
        for _ in range(40):
            sock = server.connect()
            sock.sendall(request_head("GET", "/health"))
            answer = read_response(sock)
            sock.close()
            if answer.startswith(b"HTTP/1.1 200"):
                break
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_an_unauthenticated_body_gets_401_before_it_is_sent():
    with EdgeServer(EdgeLimits(header_timeout=LONG, body_timeout=LONG, keep_alive_timeout=LONG),
                    api_key=KEY) as server:
        sock = server.connect()
        size = 2 * 2 ** 20
        sock.sendall(request_head("POST", "/echo", f"Content-Length: {size}\r\nContent-Type: application/json\r\n"))
        sock.sendall(b"x" * 65536)  # 1/32 of the body: the rest is never sent
        answer = read_response(sock, timeout=3.0)
        assert answer.startswith(b"HTTP/1.1 401") and b"authentication_error" in answer, answer[:300]
        assert b"www-authenticate: bearer" in answer.lower()
        good = server.connect()
        good.sendall(request_head("POST", "/echo", f"Authorization: Bearer {KEY}\r\nContent-Length: 10\r\n")
                     + b"0123456789")
        assert b'"bytes": 10' in read_response(good)
        open_path = server.connect()
        open_path.sendall(request_head("GET", "/health"))
        assert read_response(open_path).startswith(b"HTTP/1.1 200")  # /health needs no key


def test_a_flood_of_bad_requests_writes_a_bounded_log():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(LogRateLimit(max_lines=3))
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(handler)
    try:
        with EdgeServer(EdgeLimits(header_timeout=LONG, body_timeout=LONG, keep_alive_timeout=LONG)) as server:
            for _ in range(20):
                sock = server.connect()
                sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                assert read_response(sock).startswith(b"HTTP/1.1 400")
                sock.close()
    finally:
        uvicorn_log.removeHandler(handler)
    assert stream.getvalue().count("Invalid HTTP request") == 3, stream.getvalue()


def test_the_log_limit_drops_a_flood_and_reports_how_many():
    now = [0.0]
    limit = LogRateLimit(max_lines=5, window_s=60.0, clock=lambda: now[0])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(limit)
    second = logging.StreamHandler(io.StringIO())  # a record judged once: the same answer on every handler
    second.addFilter(limit)
    log = logging.getLogger("tests.edge.flood")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    log.addHandler(second)
    try:
        for i in range(1000):
            log.warning("refused connection %d from %s", i, "127.0.0.1")
        log.error("another kind of line")  # its own budget
        now[0] = 61.0
        log.warning("refused connection %d from %s", 1000, "127.0.0.1")
    finally:
        log.removeHandler(handler)
        log.removeHandler(second)
    lines = stream.getvalue().splitlines()
    assert lines[:5] == [f"refused connection {i} from 127.0.0.1" for i in range(5)]
    assert lines[5] == "another kind of line"
    assert lines[6] == ("refused connection 1000 from 127.0.0.1 [995 more like this dropped in the last 61 s "
                        "(--max-log-lines-per-minute)]")
    assert len(lines) == 7 and second.stream.getvalue().splitlines() == lines


def test_the_log_limit_reports_drops_not_yet_reported(caplog):
    limit = LogRateLimit(max_lines=2, window_s=60.0, clock=lambda: 0.0)
    records = [logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, "Invalid HTTP request received.",
                                 None, None) for _ in range(10)]
    assert [limit.filter(r) for r in records] == [True, True] + [False] * 8
    # on the "hybridserve" logger itself: an earlier in-process `hybridserve env` leaves it at ERROR
    with caplog.at_level(logging.WARNING, logger="hybridserve"):
        limit.report_dropped()
        limit.report_dropped()  # reported once
    assert [r.getMessage() for r in caplog.records] == [
        "8 log lines of uvicorn.error like 'Invalid HTTP request received.' were dropped (--max-log-lines-per-minute)"]


def test_bad_edge_limits_name_their_flag():
    for name, flag in (("header_timeout", "--header-timeout"), ("body_timeout", "--body-timeout"),
                       ("keep_alive_timeout", "--keep-alive-timeout")):
        for bad in (0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=flag):
                EdgeLimits(**{name: bad})
    with pytest.raises(ValueError, match="--max-connections"):
        EdgeLimits(max_connections=0)
    with pytest.raises(ValueError, match="--max-log-lines-per-minute"):
        EdgeLimits(max_log_lines_per_minute=-1)


def test_the_connection_limit_keeps_file_descriptors_free():
    assert check_max_connections(None, None) == 1024
    assert check_max_connections(None, (400, 50)) == 400 - 50 - 64  # under ulimit -n 400, room is kept
    assert check_max_connections(100, (400, 50)) == 100
    with pytest.raises(ValueError, match=r"--max-connections=500 .*ulimit -n 400.* at most 286"):
        check_max_connections(500, (400, 50))
    with pytest.raises(ValueError, match="ulimit -n 100"):
        check_max_connections(None, (100, 50))


@pytest.mark.parametrize("flag, value", [("--header-timeout", "0"), ("--body-timeout", "-1"),
                                         ("--keep-alive-timeout", "nan"), ("--max-connections", "0"),
                                         ("--max-connections", "100000000"), ("--max-log-lines-per-minute", "-5")])
def test_bad_edge_flags_are_refused_at_startup(capsys, flag, value):
    from hybridserve.entrypoints.cli import main

    assert main(["serve", "/nonexistent-model-dir", flag, value]) == 2  # before anything is loaded
    assert flag in capsys.readouterr().err


def test_edge_flags_reach_the_limits():
    from hybridserve.entrypoints.cli import build_parser
    from hybridserve.entrypoints.openai.edge_limits import edge_limits_from_args

    args = build_parser().parse_args(["serve", "--header-timeout", "1.5", "--body-timeout", "2", "--keep-alive-timeout",
                                      "0.25", "--max-connections", "7", "--max-log-lines-per-minute", "0"])
    assert edge_limits_from_args(args) == EdgeLimits(header_timeout=1.5, body_timeout=2.0, keep_alive_timeout=0.25,
                                                     max_connections=7, max_log_lines_per_minute=0)
    defaults = edge_limits_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.header_timeout, defaults.body_timeout, defaults.keep_alive_timeout) == (10.0, 60.0, 5.0)
    assert 1 <= defaults.max_connections <= 1024
