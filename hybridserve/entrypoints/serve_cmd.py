"""``hybridserve serve [MODEL_DIR]``: the OpenAI-compatible HTTP server (needs fastapi and uvicorn)."""

from __future__ import annotations

import argparse
import os

from hybridserve.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs
from hybridserve.entrypoints.openai.auth import check_api_key
from hybridserve.entrypoints.openai.cache_isolation import ISOLATION_MODES, check_isolation
from hybridserve.entrypoints.openai.edge_limits import add_edge_args, edge_limits_from_args
from hybridserve.entrypoints.openai.hosts import allowed_hosts
from hybridserve.entrypoints.openai.limits import add_limit_args, limits_from_args
from hybridserve.reasoning import REASONING_PARSERS
from hybridserve.tool_parsers import TOOL_PARSERS

#: the API name of the model shipped with hybridserve (served when no MODEL_DIR is given)
DEFAULT_MODEL_NAME = "hybridserve-default"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
                       description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                                   "tokenize, metrics). With no MODEL_DIR, the small model shipped with "
                                   "hybridserve.")
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint directory (default: the shipped model)")
    p.add_argument("--model", default=None, help="checkpoint directory (same as MODEL_DIR)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize and /detokenize (an "
                        "empty key is refused)")
    p.add_argument("--protect-metrics-and-docs", action="store_true",
                   help="require the API key on /metrics and the docs (/docs, /redoc, /openapi.json) too; "
                        "/health stays open")
    p.add_argument("--allowed-hosts", action="append", default=None, metavar="HOSTS",
                   help="comma-separated Host header names to answer to ('*' any, '*.example.com' its "
                        "subdomains; any port); others get 400. Default: on a loopback --host, only "
                        "localhost, 127.0.0.1, ::1 (and that address); on any other, every name")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME", action=_ServedNames,
                   help="the model's names in the API: /v1/models lists them all and requests may use any; the "
                        "first is the one responses and the /metrics label carry (default: the MODEL_DIR's "
                        f"base name; {DEFAULT_MODEL_NAME} for the shipped model)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests accepted but not yet running, at most; past it new requests get 503")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log level")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the prefix cache's block events over ZMQ for a KV-aware router, vLLM's JSON: "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:5557\"}' (keys: "
                        "enable_kv_cache_events, publisher, endpoint (default tcp://127.0.0.1:5557), replay_endpoint, "
                        "buffer_steps, hwm, max_queue_size, topic; needs pyzmq and msgpack). Blocks are 16-token KV "
                        "pages; unsalted prompts' token ids are published, without authentication")
    p.add_argument("--kv-events-allow-remote", action="store_true",
                   help="allow a --kv-events-config endpoint or replay endpoint beyond loopback (tcp://*:PORT, "
                        "another address); it exposes every unsalted prompt's token ids to whoever connects")
    p.add_argument("--prefix-cache-isolation", default="shared", choices=ISOLATION_MODES,
                   help="who shares the prefix cache: 'shared', every request of the same cache_salt (none: the "
                        "unsalted ones); 'api-key', requests made with the same API key and cache_salt (needs "
                        "--api-key)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format, which enables `tools` on /v1/chat/completions: 'hermes' "
                        "(<tool_call>{...}</tool_call>: Hermes, Qwen, Granite 4.0), 'granite' (<|tool_call|>[...]: "
                        "Granite 3.x). Without it a request with tools is refused (400)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's <think>...</think> into reasoning_content on "
                        "/v1/chat/completions ('think'; 'qwen3' and 'deepseek_r1' are the same format); "
                        "structured output and forced tool calls then start after the reasoning")
    add_limit_args(p)
    add_edge_args(p)
    add_engine_args(p)
    p.set_defaults(handler=run)


class _ServedNames(argparse.Action):
    """``--served-model-name A [B ...]``: ``served_model_names`` gets them all, ``served_model_name`` the first."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        names = list(values)
        for name in names:
            if not name.strip():
                parser.error(f"{option_string}: a served model name must not be empty")
        namespace.served_model_names = list(dict.fromkeys(names))  # in order, each once
        namespace.served_model_name = names[0]


def served_model_name(model: str | None) -> str:
    """The default API name of a model directory: its base name (never the path)."""
    if not model:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.abspath(model)) or model


def run(args: argparse.Namespace) -> int:
    if args.model_dir and args.model and args.model_dir != args.model:
        raise ValueError(f"two models named: MODEL_DIR={args.model_dir!r} and --model={args.model!r}")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests={args.max_waiting_requests} must be >= 1")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} must be >= 0")
    api_key = check_api_key(args.api_key)
    if args.protect_metrics_and_docs and api_key is None:
        raise ValueError("--protect-metrics-and-docs needs --api-key")
    check_isolation(args.prefix_cache_isolation, api_key)
    hosts = allowed_hosts(args.allowed_hosts, args.host)
    limits = limits_from_args(args)
    edge = edge_limits_from_args(args)
    kv_events = None
    if args.kv_events_config is not None:
        from hybridserve.entrypoints.openai.kv_events import KVEventsConfig, check_exposure

        kv_events = KVEventsConfig.from_json(args.kv_events_config)
        if not args.kv_events_allow_remote:
            check_exposure(kv_events, allow_remote=False)  # refused before the model loads (warned when it binds)
    try:
        from hybridserve.entrypoints.openai.api_server import run_server
    except ImportError as exc:
        raise ValueError(f"the server needs its extra dependencies ({exc.name} is missing): "
                         "pip install 'hybridserve[server]'") from None
    import logging

    from hybridserve.config import EngineConfig
    from hybridserve.default_model import default_model_path
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.entrypoints.gc_heap import freeze_startup_heap

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model = args.model_dir or args.model
    path = model or default_model_path()
    engine = LLMEngine(EngineConfig(model=path, enable_progress_bar=False, **engine_kwargs(args)))
    freeze_startup_heap()  # the engine lives as long as this process
    return run_server(engine, host=args.host, port=args.port, api_key=api_key,
                      model_name=getattr(args, "served_model_names", None) or served_model_name(model),
                      max_waiting_requests=args.max_waiting_requests, shutdown_timeout=args.shutdown_timeout,
                      log_level=args.log_level, limits=limits, protect_metrics_and_docs=args.protect_metrics_and_docs,
                      allowed_hosts=hosts, kv_events=kv_events, kv_events_allow_remote=args.kv_events_allow_remote,
                      prefix_cache_isolation=args.prefix_cache_isolation, edge=edge,
                      tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
