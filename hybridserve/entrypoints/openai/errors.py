"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

A 500 never shows the client its exception: the body carries a request id, and the log has the
exception under that id.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable_error"}


class APIError(StarletteHTTPException):
    """An error to answer with ``status`` and an OpenAI-style body.

    (An HTTPException, so that one raised while FastAPI reads the body passes through unchanged.)
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return self.message


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its requests were aborted."""


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: renders any string, even one with a lone surrogate."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "error"), param=param, code=code or status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return AsciiJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def internal_error(error_id: str, exc: BaseException | str) -> APIError:
    """Log ``exc`` under ``error_id``; the 500 for the client, which names only the id."""
    if isinstance(exc, BaseException):
        logger.error("internal error (request id %s): %s: %s", error_id, type(exc).__name__, exc,
                     exc_info=(type(exc), exc, exc.__traceback__))
    else:
        logger.error("internal error (request id %s): %s", error_id, exc)
    return APIError(500, f"internal error (request id {error_id})")


def new_error_id() -> str:
    return uuid.uuid4().hex[:16]


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI-style JSON (validation errors are 400, not FastAPI's 422)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, exc.param, exc.code, headers)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> JSONResponse:
        return error_response(499, "the client closed the connection; its requests were aborted")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
        first = unknown[0] if unknown else errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            where = first.get("loc", ("body", None))[-1]
            detail = (first.get("ctx") or {}).get("error", "JSON decode error")
            return error_response(400, f"the request body is not valid JSON: {detail} (at character {where})")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"{where} is not supported by this server: it is not a field of this "
                                       "request (unknown fields are refused, not ignored; docs/server.md lists the "
                                       "fields)", param=where, code="unsupported_field")
        message = f"{where}: {msg}" if where else msg
        return error_response(400, message, param=loc[0] if loc else None)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        error = internal_error(new_error_id(), exc)
        return error_response(error.status, error.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))
