"""Who may call the server: an API key on every route but the probes, and the browser origins CORS admits.

The key check is plain ASGI and sits outside the routing, so it covers every path the app answers: routes
added later, the OpenAPI document, unknown paths (no route enumeration without the key). Only /health and
/metrics stay open, for probes and scrapers.
"""
from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_response

PUBLIC_PATHS = frozenset({"/health", "/metrics"})
_UNAUTHORIZED = "Missing or invalid API key: send the header `Authorization: Bearer <key>`."


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
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        # Digests of equal length compared in constant time: neither the key's length nor how much of it
        # a guess got right shows in the response time.
        matches = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._key_digest)
        return matches and scheme.lower() == b"bearer"


def install_access_control(app: FastAPI, api_key: str | None, allowed_origins: tuple[str, ...]) -> None:
    """Call after every other middleware: the last added runs first, and CORS must wrap the key check so
    that preflights (which carry no credentials) are answered and 401s still carry CORS headers."""
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], allow_credentials=False, max_age=600)


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
