"""A request-body size limit (HTTP 413), as plain ASGI so it also covers chunked uploads."""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server's limit of {limit} bytes."


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            # Refused before a byte of the body is read.
            await error_response(413, _too_large(self.limit))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # Re-raised as-is by FastAPI's body reader and rendered by the HTTPException handler.
                    raise HTTPException(413, _too_large(self.limit))
            return message

        await self.app(scope, limited_receive, send)
