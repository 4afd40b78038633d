"""A request's JSON body: valid UTF-8, JSON (without NaN or Infinity), and no lone surrogate in any string.

A lone UTF-16 surrogate (``"\\ud800"``) is valid JSON but not valid text: no tokenizer, template or
response can carry it, so a body with one is refused here (400, naming where it is).
"""

from __future__ import annotations

import json
import re
from typing import Any

from hybridserve.entrypoints.openai.errors import APIError

#: an escaped UTF-16 surrogate (half of a pair, or a lone one); a body without one has no lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(body: bytes) -> Any:
    """The parsed body; APIError (400) if it is not UTF-8 or holds a lone surrogate. Bad JSON raises
    json.JSONDecodeError (which FastAPI answers with a 400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (at byte {exc.start})") from None
    data = json.loads(text, parse_constant=_refuse_constant)
    if _SURROGATE_ESCAPE.search(body) is not None and _has_lone_surrogate(data):
        path = _lone_surrogate_path(data)
        assert path is not None  # (_has_lone_surrogate found one)
        where = ".".join(str(p) for p in path) or "the body"
        raise APIError(400, f"{where}: contains a lone UTF-16 surrogate (not valid Unicode text)",
                       param=str(path[0]) if path else None)
    return data


def _refuse_constant(name: str) -> Any:
    raise APIError(400, f"the request body has {name}, which is not a JSON number")


def _has_lone_surrogate(data: Any) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except RecursionError:
        return _lone_surrogate_path(data) is not None
    return False


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate_path(data: Any) -> tuple | None:
    """Where the first string with a lone surrogate is (keys and indices; a bad key is shown escaped)."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if not _encodes(key):
                    return path + (ascii(key),)
                stack.append((path + (key,), item))
        elif isinstance(value, list):
            stack.extend((path + (i,), item) for i, item in reversed(list(enumerate(value))))
    return None
