"""POST /v1/completions, /v1/chat/completions, /v1/messages, /v1/responses and /v1/embeddings, answered below
FastAPI's routing.

Measured on the front end's event loop: FastAPI's per-request machinery (its middleware layers, route
matching, dependency solving) cost these two routes about 120 µs of CPU per request, more than half of
what the request costs in Python, and it wraps every streamed chunk's `send` in two more coroutines. A
burst of requests (hundreds of clients connecting at once) waits on exactly that CPU.

So these routes are taken here, by plain ASGI inside the server's own middleware (Host, CORS, API key,
size limits all still apply): the same checks StrictJSONRoute makes (a JSON Content-Type, the strict JSON
parser), the same pydantic request model, the same endpoint functions, and failures rendered by the app's
own exception handlers. The routes stay declared in FastAPI, which documents them (OpenAPI) and answers
every request this does not take (another method, a trailing slash).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.limits import StrictJSONRequest, check_json_content_type

Endpoint = Callable[[Any, Request], Awaitable[Response]]
ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


@dataclass(frozen=True)
class DirectRoute:
    body_model: type[BaseModel]
    endpoint: Endpoint          # (validated body, request) -> response, as FastAPI would call it


class DirectRoutes:
    """ASGI middleware: POSTs to `routes`' paths go to their endpoints here; everything else goes on."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, DirectRoute],
                 exception_handlers: Mapping[Any, ExceptionHandler]) -> None:
        self.app = app
        self._routes = dict(routes)
        # What Starlette's ExceptionMiddleware handles; a handler for Exception (or 500) stays with the
        # outermost ServerErrorMiddleware, which logs and answers 500 for any route.
        self._handlers = {key: handler for key, handler in exception_handlers.items()
                          if key not in (Exception, 500)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        request = StrictJSONRequest(scope, receive)
        try:
            response = await route.endpoint(await _parse_body(request, route.body_model), request)
        except Exception as exc:
            response = await self._handle(request, exc)
        await response(scope, receive, send)

    async def _handle(self, request: Request, exc: Exception) -> Response:
        for cls in type(exc).__mro__:          # the most specific handler, as Starlette looks it up
            handler = self._handlers.get(cls)
            if handler is not None:
                return await handler(request, exc)
        raise exc


async def _parse_body(request: StrictJSONRequest, model: type[BaseModel]) -> BaseModel:
    """The body as FastAPI hands it to a route with one body parameter: an empty body is a missing one,
    and validation errors are located under "body"."""
    check_json_content_type(request)
    if not await request.body():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                       "input": None}], body=None)
    payload = await request.json()
    try:
        # from_attributes: FastAPI's own validation mode, so a non-object body gets its message.
        return model.model_validate(payload, from_attributes=True)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=payload) from None
