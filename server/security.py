"""Who may call the server: the Host names it answers to, an API key on every route but the probes, and the
browser origins CORS admits.

The Host allow-list defends a server bound to loopback against DNS rebinding: a web page on an attacker's
name that re-resolves to 127.0.0.1 reaches the server from the victim's browser with `Host: attacker.example`
(Ollama's CVE-2024-28224). Bound to loopback, only localhost names are answered by default.

The key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's).
The key check is plain ASGI and sits outside the routing, so it covers every path the app answers: routes
added later, the OpenAPI document, unknown paths (no route enumeration without the key). Only /health and
/metrics stay open, for probes and scrapers.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_response

# The probes, and the dashboard page's static files (they hold no data; the page asks for the key).
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"})
_UNAUTHORIZED = "Missing or invalid API key: send the header `Authorization: Bearer <key>` or `x-api-key: <key>`."
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
ANY_HOST = "*"


def host_name(header: str) -> str | None:
    """The name part of a Host header value, lower-cased, without port or trailing dot; None if malformed."""
    value = header.strip().lower()
    if value.startswith("["):                       # [v6addr] or [v6addr]:port
        end = value.find("]")
        if end < 0 or (value[end + 1:] and not _is_port(value[end + 1:])):
            return None
        return value[:end + 1]
    name, colon, port = value.partition(":")
    if (colon and not _is_port(colon + port)) or not name or any(c in name for c in " /@\\"):
        return None
    return name.rstrip(".")


def _is_port(text: str) -> bool:
    return text.startswith(":") and text[1:].isdigit() and len(text) <= 6


def is_loopback(bind_host: str) -> bool:
    if bind_host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Bound to loopback: the localhost names only; bound elsewhere: any Host (the flag narrows it)."""
    return LOOPBACK_HOSTS if is_loopback(bind_host) else (ANY_HOST,)


def parse_allowed_hosts(value: object) -> tuple[str, ...] | None:
    """`--allowed-hosts`: comma-separated host names (any port; IPv6 in brackets) or `*`; unset: the default."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    hosts = []
    for item in (str(i).strip() for i in items if i and str(i).strip()):
        if item == ANY_HOST:
            hosts.append(item)
            continue
        name = host_name(item)
        if name is None or name != item.lower().rstrip("."):
            raise ValueError(f"host {item!r} must be a bare name or address without port or scheme, "
                             "e.g. localhost, 10.0.0.5, [::1], api.example.com; or *")
        hosts.append(name)
    if not hosts:
        raise ValueError("give at least one host name, or * for any")
    return tuple(hosts)


class HostAllowListMiddleware:
    """Answers 421 (400 for a missing or malformed Host) on every route, probes included, to a Host header
    that is not on the list; a rebinding page cannot choose its Host, so it never reaches a route."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self._allowed = frozenset(h.lower() for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"host"), None)
        name = host_name(header.decode("latin-1")) if header is not None else None
        if name is not None and name in self._allowed:
            await self.app(scope, receive, send)
            return
        if name is None:
            response = error_response(400, "Missing or malformed Host header.", code="invalid_host",
                                      path=scope.get("path"))
        else:
            response = error_response(421, f"Host {name!r} is not served here; allowed: "
                                      f"{', '.join(sorted(self._allowed))} (see --allowed-hosts).",
                                      code="host_not_allowed", path=scope.get("path"))
        await response(scope, receive, send)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty.")
        self.app = app
        self._key_digest = hashlib.sha256(api_key.encode("utf-8")).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, _UNAUTHORIZED, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"}, path=scope["path"])
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if self._matches(token.strip()) and scheme.lower() == b"bearer":
                    return True
            elif name == b"x-api-key" and self._matches(value.strip()):
                return True
        return False

    def _matches(self, token: bytes) -> bool:
        # Digests of equal length compared in constant time: neither the key's length nor how much of it
        # a guess got right shows in the response time.
        return hmac.compare_digest(hashlib.sha256(token).digest(), self._key_digest)


def install_access_control(app: FastAPI, api_key: str | None, allowed_origins: tuple[str, ...],
                           allowed_hosts: tuple[str, ...] = (ANY_HOST,)) -> None:
    """Call after every other middleware: the last added runs first, and CORS must wrap the key check so
    that preflights (which carry no credentials) are answered and 401s still carry CORS headers. The Host
    check wraps them all: a foreign Host learns nothing, not even whether a key is needed."""
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"], allow_credentials=False, max_age=600)
    if ANY_HOST not in allowed_hosts:
        app.add_middleware(HostAllowListMiddleware, allowed_hosts=allowed_hosts)


def parse_origins(value: object) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated origins (scheme://host[:port]) or `*`; empty for none."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    origins = tuple(o.strip().rstrip("/") for o in items if o and o.strip())
    for origin in origins:
        if origin != "*" and "://" not in origin:
            raise ValueError(f"origin {origin!r} must look like https://host[:port], or be *")
    return origins
