"""The HTTP edge: uvicorn's h11 protocol with deadlines on every read and a connection limit.

uvicorn closes idle kept-alive connections (``timeout_keep_alive``) but has no deadline on a request's
head or body, and its ``limit_concurrency`` answers 503 only once a request's head has arrived. So a
client trickling its headers or its body, or opening connections and sending nothing, could hold the
server's sockets for ever. This protocol adds, per connection (bounds in :class:`EdgeLimits`):

- **head deadline**: a request's line and headers must arrive within ``header_timeout`` of the
  request's first byte (of the connection's opening, for its first request);
- **body deadline**: its body must arrive within ``body_timeout`` of the end of its head (this also
  bounds how long the server drops the body of a request it has already answered, a 401 say);
- past either, the client gets 408 (if it had sent something and nothing was answered yet) and the
  connection is closed;
- **connection limit**: with ``max_connections`` connections open, a new one gets 503 at once and is
  closed (lingering at most ``REFUSAL_LINGER_S`` so that the client reads the 503 rather than a reset,
  ``MAX_LINGERING`` of them at once: past that, closed at once, so that refusals never take the file
  descriptors that FD_RESERVE keeps free); connections already open, and their requests (``/health``
  among them), go on as before.

The deadlines follow h11's view of the client: IDLE (head expected), SEND_BODY (body expected), DONE.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridserve.entrypoints.openai.edge_limits import FD_RESERVE, EdgeLimits

logger = logging.getLogger("uvicorn.error")

#: how long a refused connection stays open to let the client read its 503 (closed earlier at its EOF)
REFUSAL_LINGER_S = 1.0
#: refused connections lingering at once, at most (each holds a file descriptor)
MAX_LINGERING = FD_RESERVE // 2


def _raw_response(status: int, reason: str, message: str, kind: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class EdgeH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with head and body deadlines and a connection limit (``edge``: set by
    :func:`edge_protocol`)."""

    edge: EdgeLimits = EdgeLimits()
    lingering = 0  # refused connections lingering now (a class of edge_protocol: per server)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None  # the timer of the phase below
        self._phase: str | None = None  # "head", "body" or None (no deadline: answering, or kept alive)
        self._head_bytes = 0  # bytes received in the current head phase
        self._refused = False
        self._lingers = False  # a refused connection counted in ``lingering``

    # ---------------------------------------------------------------------------- connection limit
    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.edge.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._start("head")

    def _refuse(self, transport) -> None:
        self._refused = True
        self.transport = transport
        logger.warning("refused a connection: %d connections are open, the limit (--max-connections)",
                       len(self.connections))
        message = (f"the server holds its limit of {self.edge.max_connections:,} connections (set by "
                   "--max-connections): retry later")
        transport.write(_raw_response(503, "Service Unavailable", message, "service_unavailable_error"))
        if type(self).lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # the client reads the 503 and an end of stream; what it sends is dropped
        type(self).lingering += 1
        self._lingers = True
        self._deadline = self.loop.call_later(REFUSAL_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase is None and self.conn.their_state is h11.IDLE:
            self._start("head")  # the first byte of a new request on a kept-alive connection
        if self._phase == "head":
            self._head_bytes += len(data)
        super().data_received(data)

    def eof_received(self) -> None:
        if self._refused:
            self.transport.close()
            return
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._lingers:
            self._lingers = False
            type(self).lingering -= 1
        if self._refused:
            return
        super().connection_lost(exc)

    # ----------------------------------------------------------------------------------- deadlines
    def handle_events(self) -> None:
        super().handle_events()
        self._follow_client()

    def _follow_client(self) -> None:
        """Move the deadline to where the client is: its body, or no deadline once its request is in."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._start("body")
        elif state is not h11.IDLE:
            self._cancel()

    def _start(self, phase: str) -> None:
        self._cancel()
        self._phase = phase
        self._head_bytes = 0
        seconds = self.edge.header_timeout if phase == "head" else self.edge.body_timeout
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    def _expired(self) -> None:
        phase, self._deadline = self._phase, None
        self._phase = None
        if self.transport.is_closing():
            return
        flag, seconds = (("--header-timeout", self.edge.header_timeout) if phase == "head"
                         else ("--body-timeout", self.edge.body_timeout))
        what = "request line and headers" if phase == "head" else "request body"
        logger.info("closed a connection: its %s did not arrive within %g s (%s)", what, seconds, flag)
        # (in the head phase, a cycle is the previous request's: this one has not been answered)
        answered = phase == "body" and self.cycle is not None and self.cycle.response_started
        if not answered and (phase == "body" or self._head_bytes):
            message = f"the {what} did not arrive within {seconds:g} s (set by {flag})"
            self.transport.write(_raw_response(408, "Request Timeout", message, "invalid_request_error"))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() now says http.disconnect; its send() is dropped
            self.cycle.message_event.set()
        self.transport.close()


def edge_protocol(edge: EdgeLimits) -> type[EdgeH11Protocol]:
    """The protocol class for uvicorn's ``http=`` with these bounds."""
    return type("EdgeH11Protocol", (EdgeH11Protocol,), {"edge": edge})
