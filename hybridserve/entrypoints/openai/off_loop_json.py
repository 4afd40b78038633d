"""Large JSON responses, built and serialized off the event loop, so that ``/health`` and other requests keep
being answered while one is made.

A response of many choices with logprobs (up to ``--max-response-entries`` entries, tens of MB) takes
seconds of Python to build; done on the event loop it would stall every other client for that long. In a
worker thread the loop still gets the interpreter every switch interval (5 ms). The JSON is written one
choice at a time, so no single call holds the interpreter for the whole body.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from pydantic import BaseModel
from starlette.responses import Response


def choices_json(response: BaseModel) -> bytes:
    """``response`` (a model with a ``choices`` list) as JSON, written choice by choice (fields in any order)."""
    head = response.model_dump_json(exclude={"choices"})  # '{"id":...,"usage":...}'
    choices = ",".join(choice.model_dump_json() for choice in response.choices)
    return f'{head[:-1]},"choices":[{choices}]}}'.encode()


async def json_response_off_loop(build: Callable[[], BaseModel]) -> Response:
    """The JSON response of the model ``build()`` returns, built and serialized in a worker thread."""
    body = await asyncio.to_thread(lambda: choices_json(build()))
    return Response(body, media_type="application/json")
