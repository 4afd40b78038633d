"""Cache salts: the tenant a request's prefix-cache entries belong to (vLLM's ``cache_salt``).

Requests with different salts never share a cached page or a state snapshot: the prefix index keeps one tree
per salt (:class:`hybridserve.cache.prefix_index.PrefixIndex`), so a salted request only ever hits what the
same salt stored, and an unsalted one (salt ``None``) only what other unsalted ones stored. Prefix sharing
between requests queued together, and the KV events a router reads, follow the same rule
(docs/prefix_caching.md, "Isolation").
"""

from __future__ import annotations

#: the longest ``cache_salt`` accepted, in characters
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: object) -> str | None:
    """``salt`` if it is None or a non-empty string of at most :data:`MAX_CACHE_SALT_CHARS` characters;
    ValueError naming the rule otherwise."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, not {type(salt).__name__}")
    if not salt:
        raise ValueError("cache_salt must not be empty (leave the field out for no salt)")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt is {len(salt)} characters long; at most {MAX_CACHE_SALT_CHARS} are allowed")
    return salt
