"""ASGI middleware: a request body larger than the limit gets 413 before anything parses it.

The body is read here, whole, before the app sees it: ``Content-Length`` is checked first, and a
chunked body is counted while it arrives, so at most ``limit`` bytes are ever held. A refused body is
drained (up to ``DRAIN_BYTES`` more) before the answer, so that the client, still sending, reads the
413 instead of a reset connection.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from hybridserve.entrypoints.openai.limits import ServerLimits

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

#: past the limit, how many more bytes are read and dropped before answering
DRAIN_BYTES = 64 * 2 ** 20


class BodySizeLimit:
    """Refuse (413) HTTP request bodies over ``limits.max_body_bytes``; hand the app the body read so far."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            # a client that waits for "100 Continue" sends nothing more; one far past the limit is not drained
            drain = _header(scope, b"expect").lower() != b"100-continue" and declared <= limit + DRAIN_BYTES
            await self._refuse(send, receive if drain else None, f"a body of {declared:,} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                more = message.get("more_body", False)  # past the last part, receive() waits for a disconnect
                await self._refuse(send, receive if more else None, f"a body of more than {limit:,} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send, receive: Receive | None, subject: str) -> None:
        if receive is not None:
            await _drain(receive)
        message = self.limits.exceeded("max_body_bytes", f"the request has {subject}")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the whole body once, then the connection's own messages (disconnects)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _drain(receive: Receive) -> None:
    dropped = 0
    while dropped <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return b""


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length").strip()
    return int(value) if value.isdigit() else None
