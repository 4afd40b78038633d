"""The FastAPI app and its uvicorn server.

Routes: ``GET /health``, ``GET /metrics``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /tokenize``, ``POST /detokenize``, the API docs (``/docs``,
``/redoc``, ``/openapi.json``), and what a router in front of several replicas uses
(:mod:`serving_router`: ``POST /v1/completions/render``, ``POST /v1/chat/completions/render``,
``GET /get_load``, ``POST /flush_cache``, ``POST /reset_prefix_cache``). With an API key set, every path
but ``/health`` (for probes), ``/metrics`` and the docs needs ``Authorization: Bearer KEY``; ``/metrics``
and the docs too with ``protect_metrics_and_docs``.

Below the app, the HTTP edge (:mod:`http_edge`): deadlines on each request's head and body and a
connection limit. In front of every route: the Host header check (:mod:`hosts`), the API key from the
headers (:mod:`early_auth`), then the body size limit (:mod:`body_limit`); in every route, the body
checks of :mod:`routing`. Docs: ``docs/server.md``.

Shutdown (SIGTERM or SIGINT): the listening socket closes at once and new requests get 503; requests
in flight get ``shutdown_timeout`` seconds to finish, then are aborted (each stream ends with
``finish_reason="abort"``); the engine thread stops and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response

from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.entrypoints.openai.auth import check_api_key
from hybridserve.entrypoints.openai.body_limit import BodySizeLimit
from hybridserve.entrypoints.openai.cache_isolation import check_isolation
from hybridserve.entrypoints.openai.early_auth import EarlyAuth
from hybridserve.entrypoints.openai.edge_limits import EdgeLimits
from hybridserve.entrypoints.openai.errors import APIError, install_error_handlers
from hybridserve.entrypoints.openai.hosts import AllowedHosts
from hybridserve.entrypoints.openai.http_edge import edge_protocol
from hybridserve.entrypoints.openai.kv_events import KVEventsConfig, ZmqEventPublisher
from hybridserve.entrypoints.openai.limits import ServerLimits
from hybridserve.entrypoints.openai.log_limit import install_log_limit
from hybridserve.entrypoints.openai.metrics import metrics_registry, render
from hybridserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from hybridserve.entrypoints.openai.routing import CheckedRoute
from hybridserve.entrypoints.openai.serving_chat import create_chat_completion
from hybridserve.entrypoints.openai.serving_common import ServerState
from hybridserve.entrypoints.openai.serving_completion import create_completion
from hybridserve.entrypoints.openai.serving_router import flush_cache, load, render_chat, render_completion
from hybridserve.entrypoints.openai.serving_tokenize import detokenize, tokenize
from hybridserve.entrypoints.openai.tokenizer_worker import TokenizerWorker
from hybridserve.reasoning import reasoning_parser as reasoning_parser_named
from hybridserve.tool_parsers import tool_parser

logger = logging.getLogger(__name__)


def build_app(state: ServerState, allowed_hosts: tuple[str, ...] | None = None) -> FastAPI:
    """The app (``allowed_hosts``: the Host names it answers to, None for any); its lifespan starts
    and stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.shutdown()
            state.tokenizer.close()

    app = FastAPI(title="hybridserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = CheckedRoute
    app.state.hybridserve = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, limits=state.limits)
    # the key, from the headers: a client without it never gets its body read
    app.add_middleware(EarlyAuth, api_key=state.api_key, protect_metrics_and_docs=state.protect_metrics_and_docs)
    app.add_middleware(AllowedHosts, allowed=allowed_hosts)  # added last: runs first

    def accepting() -> None:
        if not state.engine.accepting:
            raise APIError(503, getattr(state.engine, "down_reason", None) or "the server is shutting down")

    v1 = [Depends(accepting)]  # the API key: EarlyAuth

    @app.get("/health")
    async def health() -> Any:
        if not state.engine.accepting:
            raise APIError(503, getattr(state.engine, "down_reason", None) or "the server is shutting down")
        return JSONResponse({"status": "ok"})

    # this server's own; ``salted`` lookups are shown only to holders of the key (entrypoints/openai/metrics.py)
    registry = metrics_registry(state.engine, state.model_name, show_salted=state.protect_metrics_and_docs)

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: scrapers' reachability probe
    async def metrics(request: Request) -> Any:
        body, content_type = render(registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Any:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Any:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="hybridserve - API docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> Any:
        return get_redoc_html(openapi_url="/openapi.json", title="hybridserve - API docs")

    @app.get("/v1/models")
    async def models() -> Any:
        cards = [ModelCard(id=name, root=state.model_name, max_model_len=state.max_model_len)
                 for name in state.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return _respond(await create_completion(state, body, raw))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return _respond(await create_chat_completion(state, body, raw))

    @app.post("/tokenize", dependencies=v1)
    async def tokenize_route(body: TokenizeRequest) -> Any:
        return _respond(await tokenize(state, body))

    @app.post("/detokenize", dependencies=v1)
    async def detokenize_route(body: DetokenizeRequest) -> Any:
        return _respond(await detokenize(state, body))

    @app.post("/v1/completions/render", dependencies=v1)
    async def completions_render(body: CompletionRequest) -> Any:
        return JSONResponse([p.model_dump() for p in await render_completion(state, body)])

    @app.post("/v1/chat/completions/render", dependencies=v1)
    async def chat_completions_render(body: ChatCompletionRequest) -> Any:
        return _respond(await render_chat(state, body))

    @app.get("/get_load")
    async def get_load() -> Any:
        return _respond(load(state))

    @app.post("/flush_cache", dependencies=v1)
    @app.post("/reset_prefix_cache", dependencies=v1)
    async def flush() -> Any:
        return JSONResponse(await flush_cache(state))

    return app


def _respond(result: Any) -> Any:
    if hasattr(result, "model_dump"):
        return JSONResponse(result.model_dump())
    return result  # a StreamingResponse


class _Server(uvicorn.Server):
    """uvicorn's server, with our shutdown: drain for a grace period, abort the rest, exit 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGTERM and SIGINT start a graceful shutdown, after which the process exits normally.

        (uvicorn's own version re-raises the signal once shut down, which makes the exit status
        "killed by SIGTERM" instead of 0.)
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        self.engine.stop_accepting()
        logger.info("shutting down: %.1f s for the requests in flight to finish", self.shutdown_timeout)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run_server(engine: LLMEngine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               model_name: str | list[str] | tuple[str, ...], max_waiting_requests: int | None = None,
               shutdown_timeout: float = 30.0,
               log_level: str = "info", limits: ServerLimits | None = None, protect_metrics_and_docs: bool = False,
               allowed_hosts: tuple[str, ...] | None = None, kv_events: KVEventsConfig | None = None,
               kv_events_allow_remote: bool = False, prefix_cache_isolation: str = "shared",
               edge: EdgeLimits | None = None, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> int:
    """Serve ``engine`` until SIGTERM/SIGINT; 0 after a clean shutdown, 1 if the server could not start.

    ``model_name``: the name requests may use, or several (the first is the one responses carry).
    ``edge``: the connection bounds (:mod:`http_edge`; the defaults of EdgeLimits if None).
    ``kv_events``: publish the prefix cache's block events as it says (:mod:`kv_events`), when active; an endpoint
    beyond loopback needs ``kv_events_allow_remote``. ``prefix_cache_isolation``: :mod:`cache_isolation`.
    ``tool_call_parser`` / ``reasoning_parser``: the names of the parsers chat replies are read with (tools are
    refused without the first; :mod:`chat_tools`).

    Raises ValueError for a key that cannot be used (empty, say) or docs protection without a key.
    """
    api_key = check_api_key(api_key)
    if protect_metrics_and_docs and api_key is None:
        raise ValueError("--protect-metrics-and-docs needs --api-key")
    check_isolation(prefix_cache_isolation, api_key)
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    tools = tool_parser(tool_call_parser) if tool_call_parser else None
    reasoning = reasoning_parser_named(reasoning_parser) if reasoning_parser else None
    publisher = None
    if kv_events is not None and kv_events.active:
        engine.enable_kv_events()
        publisher = ZmqEventPublisher(kv_events, allow_remote=kv_events_allow_remote)
        logger.info("publishing KV cache events on %s (topic %r, block size %d)", kv_events.endpoint,
                    kv_events.topic, engine.cache.pool.layout.block_size)
    state = ServerState(engine=AsyncEngine(engine, max_waiting_requests,
                                           kv_events=publisher.publish if publisher is not None else None),
                        tokenizer=TokenizerWorker(engine.config.tokenizer or engine.config.model, engine.max_model_len),
                        model_name=names[0], max_model_len=engine.max_model_len, api_key=api_key,
                        limits=limits or ServerLimits(), protect_metrics_and_docs=protect_metrics_and_docs,
                        extra_model_names=names[1:], prefix_cache_isolation=prefix_cache_isolation,
                        tool_parser=tools, reasoning_parser=reasoning)
    edge = edge or EdgeLimits()
    config = uvicorn.Config(build_app(state, allowed_hosts), host=host, port=port, log_level=log_level,
                            lifespan="on", timeout_graceful_shutdown=shutdown_timeout + 5.0,
                            http=edge_protocol(edge), timeout_keep_alive=edge.keep_alive_timeout,
                            ws="none")  # no WebSocket routes: an upgrade request is a plain HTTP request
    log_limit = install_log_limit(edge.max_log_lines_per_minute)  # on the handlers uvicorn's Config just set up
    logger.info("HTTP edge: request heads within %g s, bodies within %g s, idle connections closed after %g s, "
                "at most %d connections", edge.header_timeout, edge.body_timeout, edge.keep_alive_timeout,
                edge.max_connections)
    server = _Server(config, state.engine, shutdown_timeout)
    try:
        server.run()
    finally:
        if publisher is not None:
            publisher.close()
        if log_limit is not None:
            log_limit.report_dropped()
    return 0 if server.started else 1
