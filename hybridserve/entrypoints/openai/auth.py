"""The API key: what a valid one is, and the ``Authorization: Bearer KEY`` check (constant-time)."""

from __future__ import annotations

import secrets


def check_api_key(key: str | None) -> str | None:
    """``key`` if it can be sent in a header and matched; ValueError otherwise (an empty key never
    means "no authentication": leave ``--api-key`` out for that)."""
    if key is None:
        return None
    if not key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if key != key.strip() or not all(" " <= c <= "~" for c in key):
        raise ValueError("--api-key must be printable ASCII, without leading or trailing whitespace "
                         "(it is sent in an HTTP header)")
    return key


def bearer_matches(header: str, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>``."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
