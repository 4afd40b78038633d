"""The Host header check: the server answers only to the host names it is meant to have.

A browser page on another site can reach a server on loopback through a name that the attacker
resolves to 127.0.0.1 (DNS rebinding); its requests then carry that name in ``Host``. So a server
listening on a loopback address accepts, by default, only the loopback names (``localhost``,
``127.0.0.1``, ``::1``, and the address it listens on), on any port; elsewhere any name, unless
``--allowed-hosts`` lists them (``*`` for any, ``*.example.com`` for its subdomains).
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host.strip().lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _normal(name: str) -> str:
    """A host name or IP address in one canonical form (lower case, no trailing dot, compressed IPv6)."""
    name = name.lower().rstrip(".")
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name


def host_name(header: str) -> str | None:
    """The host of a ``Host`` header value without its port (``[::1]:8000`` -> ``::1``); None if malformed."""
    value = header.strip()
    if value.startswith("["):  # an IPv6 literal
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
        if rest and not (rest[0] == ":" and rest[1:].isdigit() or rest == ":"):
            return None
        try:
            return ipaddress.IPv6Address(name).compressed
        except ValueError:
            return None
    name, _, port = value.partition(":")
    if not name or ":" in port or (port and not port.isdigit()):
        return None  # empty, or an IPv6 address without brackets, or a bad port
    return _normal(name)


def allowed_hosts(flag_values: list[str] | None, listen_host: str) -> tuple[str, ...] | None:
    """The names to accept (None: any), from ``--allowed-hosts`` values (comma-separated lists) or the default."""
    if not flag_values:
        if not is_loopback(listen_host):
            return None
        listen = _normal(listen_host.strip().strip("[]"))
        return LOOPBACK_NAMES + (() if listen in LOOPBACK_NAMES else (listen,))
    names: list[str] = []
    for value in flag_values:
        for entry in value.split(","):
            if entry.strip() == "*":
                return None
            names.append(_entry(entry.strip(), value))
    return tuple(names)


def _entry(entry: str, value: str) -> str:
    """One ``--allowed-hosts`` entry in canonical form: a name, ``*.domain``, or an IP address."""
    wildcard = entry.startswith("*.")
    name = entry[2:] if wildcard else entry
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        ip = None
    if ip is not None and not wildcard:
        return ip.compressed
    if ip is not None or not bare or any(c in bare for c in ":/[] *"):
        raise ValueError(f"--allowed-hosts={value!r}: {entry!r} is not a host name, *.domain or IP address "
                         "(give names without ports, separated by commas)")
    return ("*." if wildcard else "") + _normal(bare)


def host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        if name == entry or entry.startswith("*.") and name.endswith(entry[1:]):
            return True
    return False


class AllowedHosts:
    """ASGI middleware: HTTP requests whose ``Host`` is not in ``allowed`` get 400 (``None`` lets all in)."""

    def __init__(self, app: Any, allowed: tuple[str, ...] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.allowed is None:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"host"), None)
        text = header.decode("latin-1") if header is not None else None
        name = host_name(text) if text is not None else None
        if name is not None and host_allowed(name, self.allowed):
            await self.app(scope, receive, send)
            return
        shown = "missing" if text is None else repr(text[:100])
        message = (f"the Host header ({shown}) is not a name this server answers to; allowed: "
                   f"{', '.join(self.allowed)} (set by --allowed-hosts)")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": "Host",
                                     "code": 400}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
