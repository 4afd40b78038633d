"""The server's parts without a model: Host check, body limit, body parsing, errors with request ids."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from hybridserve.engine.async_engine import RequestFailedError
from hybridserve.entrypoints.openai.body_limit import BodySizeLimit
from hybridserve.entrypoints.openai.errors import APIError, install_error_handlers
from hybridserve.entrypoints.openai.hosts import AllowedHosts, allowed_hosts, host_allowed, host_name
from hybridserve.entrypoints.openai.json_body import parse_body
from hybridserve.entrypoints.openai.limits import ServerLimits
from hybridserve.entrypoints.openai.routing import CheckedRoute
from hybridserve.entrypoints.openai.serving_common import EngineRequests, sse_stream
from hybridserve.sampling_params import SamplingParams

SECRET = "secret internal detail"


# --------------------------------------------------------------------------------------------- hosts
@pytest.mark.parametrize("header, name", [
    ("localhost", "localhost"), ("LocalHost:8000", "localhost"), ("localhost.", "localhost"),
    ("127.0.0.1:80", "127.0.0.1"), ("[::1]", "::1"), ("[::1]:8000", "::1"), ("[0:0:0:0:0:0:0:1]:1", "::1"),
    ("example.com:", "example.com"), ("::1", None), ("[::1", None), ("[::1]x", None), ("[evil]:80", None),
    ("a:b", None), ("a:80:90", None), ("", None), (":80", None),
])
def test_host_name(header, name):
    assert host_name(header) == name


def test_allowed_hosts_defaults_and_flag():
    assert allowed_hosts(None, "127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts(None, "::1") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts(None, "127.0.0.2")[-1] == "127.0.0.2"  # the address it listens on, too
    assert allowed_hosts(None, "0.0.0.0") is None and allowed_hosts(None, "10.1.2.3") is None
    assert allowed_hosts(["a.example, *.B.example", "[::1]"], "0.0.0.0") == ("a.example", "*.b.example", "::1")
    assert allowed_hosts(["a.example,*"], "127.0.0.1") is None
    for bad in ("a.example:80", "", "a,,b", "http://a.example", "*.10.0.0.1"):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            allowed_hosts([bad], "127.0.0.1")
    allowed = ("a.example", "*.b.example")
    assert host_allowed("a.example", allowed) and host_allowed("x.y.b.example", allowed)
    assert not host_allowed("b.example", allowed) and not host_allowed("xa.example", allowed)


def _echo_app(limits: ServerLimits | None = None, hosts: tuple[str, ...] | None = None) -> FastAPI:
    app = FastAPI()
    app.router.route_class = CheckedRoute
    app.state.hybridserve = SimpleNamespace(limits=limits or ServerLimits())
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    @app.post("/parsed")
    async def parsed(body: dict) -> dict:
        return {"keys": sorted(body)}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError(SECRET)

    app.add_middleware(BodySizeLimit, limits=limits or ServerLimits())
    app.add_middleware(AllowedHosts, allowed=hosts)
    return app


def test_host_middleware():
    client = TestClient(_echo_app(hosts=("localhost", "::1")), base_url="http://localhost:8000")
    assert client.post("/echo", content=b"{}").status_code == 200
    assert client.post("/echo", content=b"{}", headers={"Host": "[::1]:9"}).status_code == 200
    r = client.post("/echo", content=b"{}", headers={"Host": "evil.example"})
    assert r.status_code == 400 and "Host" in r.json()["error"]["message"] and r.json()["error"]["param"] == "Host"


# ---------------------------------------------------------------------------------------- body limit
def test_body_limit():
    client = TestClient(_echo_app(ServerLimits(max_body_bytes=1000)))
    assert client.post("/echo", content=b"x" * 1000).json() == {"size": 1000}
    r = client.post("/echo", content=b"x" * 1001)
    assert r.status_code == 413
    assert "--max-request-body-size" in r.json()["error"]["message"] and "1,000" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(10):
            yield b"x" * 300

    r = client.post("/echo", content=chunks())
    assert r.status_code == 413 and "more than 1,000 bytes" in r.json()["error"]["message"]
    assert client.post("/echo", content=iter([b"x" * 300] * 3)).json() == {"size": 900}


# --------------------------------------------------------------------------------------- body checks
def test_parse_body():
    assert parse_body('{"p": "smile \\ud83d\\ude00"}'.encode()) == {"p": "smile \U0001f600"}  # a pair is fine
    for raw, where in [(b'{"p": ["ok", "\\ud800"]}', "p.1"), (b'{"m": [{"role": "\\uDC00"}]}', "m.0.role"),
                       (b'{"\\ud800": 1}', "'\\ud800'")]:
        with pytest.raises(APIError, match="surrogate") as info:
            parse_body(raw)
        assert info.value.status == 400 and info.value.message.startswith(where)
    with pytest.raises(APIError, match="UTF-8"):
        parse_body(b'{"p": "\xed\xa0\x80"}')
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(APIError, match=constant):
            parse_body(f'{{"temperature": {constant}}}'.encode())


def test_body_checks_in_routes():
    client = TestClient(_echo_app(ServerLimits(max_prompts=2, max_messages=3)))
    assert client.post("/parsed", json={"prompt": ["a", "b"]}).json() == {"keys": ["prompt"]}
    assert client.post("/parsed", json={"prompt": list(range(50))}).status_code == 200  # one token-id prompt
    r = client.post("/parsed", json={"prompt": ["a", "b", "c"]})
    assert r.status_code == 400 and "--max-prompts-per-request" in r.json()["error"]["message"]
    r = client.post("/parsed", json={"messages": [{"role": "user", "content": "x"}] * 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/parsed", content='{"p": 1', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")
    r = client.post("/parsed", content='{"p": "\\ud800"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


# --------------------------------------------------------------------------------- internal errors
def test_500_names_a_request_id_not_the_exception(caplog):
    client = TestClient(_echo_app(), raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR):
        r = client.get("/boom")
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert SECRET not in r.text and message.startswith("internal error (request id ")
    error_id = message.removeprefix("internal error (request id ").rstrip(")")
    assert any(error_id in rec.getMessage() and SECRET in rec.getMessage() for rec in caplog.records)


def test_in_band_stream_error_names_a_request_id(caplog):
    class Requests:
        base_id = "cmpl-test"
        aborted = False

        def abort(self):
            self.aborted = True

    async def events():
        yield "data: first\n\n"
        raise RuntimeError(SECRET)

    async def collect(requests):
        return [e async for e in sse_stream(events(), requests)]

    requests = Requests()
    with caplog.at_level(logging.ERROR):
        out = asyncio.run(collect(requests))
    assert out[0] == "data: first\n\n" and out[-1] == "data: [DONE]\n\n" and requests.aborted
    error = json.loads(out[1].removeprefix("data: "))["error"]
    assert error["message"] == "internal error (request id cmpl-test)" and SECRET not in out[1]
    assert any("cmpl-test" in rec.getMessage() and SECRET in rec.getMessage() for rec in caplog.records)


def test_failed_engine_request_is_a_500_with_its_id(caplog):
    class Engine:
        def __init__(self):
            self.aborted: list[str] = []

        async def add_requests(self, new, sink):
            self.sink = sink

        def abort(self, request_id):
            self.aborted.append(request_id)

    async def run(engine):
        requests = EngineRequests(engine, "cmpl-x", [([1, 2], None), ([3], None)], SamplingParams(max_tokens=2))
        await requests.start()
        engine.sink.fail(RequestFailedError("cmpl-x-1", SECRET))
        with pytest.raises(APIError) as info:
            await requests.wait()
        return info.value

    engine = Engine()
    with caplog.at_level(logging.ERROR):
        error = asyncio.run(run(engine))
    assert error.status == 500 and error.message == "internal error (request id cmpl-x-1)"
    assert sorted(engine.aborted) == ["cmpl-x-0", "cmpl-x-1"]  # the rest of the HTTP request is aborted
    assert any("cmpl-x-1" in rec.getMessage() and SECRET in rec.getMessage() for rec in caplog.records)


def test_limits_validate_and_name_their_flags():
    with pytest.raises(ValueError, match="--max-n"):
        ServerLimits(max_n=0)
    message = ServerLimits().exceeded("max_stop_strings", "stop has 17 strings")
    assert message == ("stop has 17 strings: more than this server's limit of 16 stop strings "
                       "(set by --max-stop-strings)")
