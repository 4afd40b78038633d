"""The routes' request class and handler wrapper.

Every route's JSON body goes through :func:`json_body.parse_body` and the count limits before
FastAPI validates it; an unexpected exception in a route becomes a 500 naming a request id (the
exception goes to the log under that id, never to the client).
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from hybridserve.entrypoints.openai.errors import ClientDisconnected, error_response, internal_error, new_error_id
from hybridserve.entrypoints.openai.json_body import parse_body
from hybridserve.entrypoints.openai.limit_checks import check_counts

#: exceptions that the app's handlers answer themselves
_HANDLED = (StarletteHTTPException, RequestValidationError, ClientDisconnected)


class CheckedRequest(Request):
    """A request whose ``json()`` refuses bad text and over-limit counts before anything is validated."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            data = parse_body(await self.body())
            check_counts(data, self.app.state.hybridserve.limits)
            self._json = data
        return self._json


class CheckedRoute(APIRoute):
    """An APIRoute whose requests are :class:`CheckedRequest` and whose unexpected errors are clean 500s."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            try:
                return await handler(CheckedRequest(request.scope, request.receive))
            except _HANDLED:
                raise
            except Exception as exc:  # noqa: BLE001 - logged with an id; the client sees only the id
                error = internal_error(new_error_id(), exc)
                return error_response(error.status, error.message)

        return checked
