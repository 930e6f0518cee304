"""What a request may be: headers of at most 64 KiB and 256 fields (HTTP 431), a body of at most
--max-body-bytes (HTTP 413, as plain ASGI so it also covers chunked uploads), and JSON that parses into
valid Unicode (HTTP 400 with a reason otherwise).

uvicorn's httptools parser puts no bound on header size (a 5 MB header is read whole), so the header check
here at least keeps such a request from going further.

FastAPI parses bodies with `json.loads`, which turns a lone `\\ud800` escape into a Python string that no
tokenizer or UTF-8 encoder accepts, and reports nesting that is too deep or a 5000-digit number only as
"There was an error parsing the body". Routes built with `StrictJSONRoute` parse the body here instead.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 256
# Any \\uD800-\\uDFFF escape; only when one is present can a parsed string hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server's limit of {limit} bytes."


class RequestSizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            message = f"The request headers exceed {MAX_HEADERS} fields or {MAX_HEADER_BYTES} bytes."
            await error_response(431, message, path=scope["path"])(scope, receive, send)
            return
        declared = dict(headers).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            # Refused before a byte of the body is read.
            await error_response(413, _too_large(self.limit), path=scope["path"])(scope, receive, send)
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


def parse_json_body(body: bytes) -> Any:
    """The body as JSON, or HTTP 400 saying what is wrong with it."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise HTTPException(400, f"The body is not valid JSON: {exc.msg} at position {exc.pos}.") from None
    except UnicodeDecodeError:
        raise HTTPException(400, "The body is not valid UTF-8.") from None
    except RecursionError:
        raise HTTPException(400, "The JSON body is nested too deeply.") from None
    except ValueError:      # e.g. an integer with thousands of digits
        raise HTTPException(400, "The body is not valid JSON: a number in it is too long.") from None
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(value):
        raise HTTPException(400, "The body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                                 "strings must be valid Unicode.")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """Walks the parsed body without recursion (it may be nested close to the parser's limit)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


def check_json_content_type(request: Request) -> None:
    """Without `Content-Type: application/json` FastAPI would not parse the body as JSON and would answer with
    a puzzling validation error (curl -d sends application/x-www-form-urlencoded): say what to send instead."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type header"
        raise HTTPException(400, f"Send the request body as JSON with the header Content-Type: application/json "
                                 f"(this request has {got}).")


class StrictJSONRoute(APIRoute):
    """A FastAPI route whose JSON body is parsed by `parse_json_body`, and must be declared JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                check_json_content_type(request)
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
