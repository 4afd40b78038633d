"""``--prefix-cache-isolation``: whose requests may share the prefix cache.

* ``shared`` (the default): every request without a ``cache_salt`` shares one cache; a request with one shares
  only with requests carrying the same salt (vLLM's semantics; :mod:`hybridserve.cache.salt`).
* ``api-key``: the salt of every request is derived from the API key it authenticated with, combined with the
  client's own ``cache_salt`` if it sent one, so requests made with different keys never share, and clients
  of one key can still separate themselves with salts. It needs ``--api-key``. hybridserve takes one key,
  so all holders of it are one tenant; the salt follows the key each request presents, so a deployment that
  gives each tenant its own key (one server per key, or several keys in front) keeps them apart.

A derived salt is a SHA-256 digest of the key and the client's salt, never the key itself: the prefix index
keeps salts in memory, and nothing else about them leaves the engine (salted blocks are not published as KV
events).
"""

from __future__ import annotations

import hashlib
import json

#: the values of ``--prefix-cache-isolation``
ISOLATION_MODES = ("shared", "api-key")


def check_isolation(mode: str, api_key: str | None) -> str:
    """``mode`` if it is one of :data:`ISOLATION_MODES` and has what it needs; ValueError otherwise."""
    if mode not in ISOLATION_MODES:
        raise ValueError(f"--prefix-cache-isolation={mode!r} is not one of {', '.join(ISOLATION_MODES)}")
    if mode == "api-key" and api_key is None:
        raise ValueError("--prefix-cache-isolation=api-key needs --api-key: the cache is keyed by the key each "
                         "request authenticates with")
    return mode


def presented_key(authorization: str) -> str:
    """The key of an ``Authorization: Bearer KEY`` header value (as :func:`auth.bearer_matches` reads it)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def request_cache_salt(mode: str, client_salt: str | None, authorization: str) -> str | None:
    """The cache salt a request runs with: the client's own in ``shared`` mode; in ``api-key`` mode one derived
    from the key in ``authorization`` (an authenticated request's header) and the client's salt."""
    if mode == "shared":
        return client_salt
    digest = hashlib.sha256(json.dumps([presented_key(authorization), client_salt]).encode()).hexdigest()
    return f"api-key:{digest}"
