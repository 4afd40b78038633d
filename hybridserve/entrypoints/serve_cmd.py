"""``hybridserve serve [MODEL_DIR]``: the OpenAI-compatible HTTP server (needs fastapi and uvicorn)."""

from __future__ import annotations

import argparse

from hybridserve.entrypoints.engine_args import add_engine_args, engine_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                                   "metrics). With no MODEL_DIR, the small model shipped with hybridserve.")
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint directory (default: the shipped model)")
    p.add_argument("--model", default=None, help="checkpoint directory (same as MODEL_DIR)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the MODEL_DIR as given)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests accepted but not yet running, at most; past it new requests get 503")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.model_dir and args.model and args.model_dir != args.model:
        raise ValueError(f"two models named: MODEL_DIR={args.model_dir!r} and --model={args.model!r}")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests={args.max_waiting_requests} must be >= 1")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} must be >= 0")
    try:
        from hybridserve.entrypoints.openai.api_server import run_server
    except ImportError as exc:
        raise ValueError(f"the server needs its extra dependencies ({exc.name} is missing): "
                         "pip install 'hybridserve[server]'") from None
    import logging

    from hybridserve.config import EngineConfig
    from hybridserve.default_model import default_model_path
    from hybridserve.engine.llm_engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model = args.model_dir or args.model
    path = model or default_model_path()
    engine = LLMEngine(EngineConfig(model=path, enable_progress_bar=False, **engine_kwargs(args)))
    name = args.served_model_name or model or "hybridserve-default"
    return run_server(engine, host=args.host, port=args.port, api_key=args.api_key, model_name=name,
                      model_path=path, max_waiting_requests=args.max_waiting_requests,
                      shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
