"""ASGI middleware: the API key is checked from the request's headers, before its body is read.

So a client without the key cannot make the server read or hold its body: it gets 401 at once (the
server then drops whatever body it still sends, within ``--body-timeout``). Every path needs the key
except ``/health`` (for probes) and, unless ``protect_metrics_and_docs``, ``/metrics`` and the API docs.
"""

from __future__ import annotations

import json
from typing import Any

from hybridserve.entrypoints.openai.auth import bearer_matches

#: paths open to every client
OPEN_PATHS = frozenset({"/health"})
#: paths open unless --protect-metrics-and-docs
METRICS_AND_DOCS = frozenset({"/metrics", "/docs", "/redoc", "/openapi.json"})
MESSAGE = "invalid or missing API key: send 'Authorization: Bearer <key>'"


class EarlyAuth:
    """Answer 401 to a request without ``Authorization: Bearer <api_key>`` on a protected path, from its
    headers alone (``api_key`` None: every request passes)."""

    def __init__(self, app: Any, api_key: str | None, protect_metrics_and_docs: bool = False) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = OPEN_PATHS if protect_metrics_and_docs else OPEN_PATHS | METRICS_AND_DOCS

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.api_key is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        if bearer_matches(header.decode("latin-1"), self.api_key):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": MESSAGE, "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
