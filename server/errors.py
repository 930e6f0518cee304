"""The error envelopes, and the handlers that turn every failure into one.

Clients (the openai SDK among them) parse `{"error": {"message", "type", "param", "code"}}`; anything a user
can cause answers 4xx in that shape, and internal failures answer 500 without a stack trace. The Anthropic
Messages routes (/v1/messages...) answer in Anthropic's shape instead, `{"type": "error", "error": {"type",
"message"}}`, with its type names: the anthropic SDK reads those. The shape follows the request's path, so
that failures met before a route runs (key, Host, body size, validation) are in the route's shape too.
"""
from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagedserve.server")

# OpenAI's `type` values for the statuses this server answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}
# Anthropic's `type` values (its SDK maps 529 and 503 to overloaded_error).
_ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"
_MAX_VALIDATION_ERRORS = 5


class APIError(Exception):
    """An error with an HTTP status; raised by handlers, rendered by `install_error_handlers`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


def is_anthropic_path(path: str | None) -> bool:
    """The routes that answer in Anthropic's error shape: /v1/messages and everything under it."""
    return path is not None and (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"))


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    err_type = _ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": err_type, "message": message}}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    err_type = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: a message quoting client input (a model name, a key) renders even when that
    input holds characters UTF-8 cannot encode, such as a lone surrogate."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
    """The error in the shape of the route at `path` (the OpenAI envelope unless it is an Anthropic route)."""
    body = anthropic_error_body(status, message) if is_anthropic_path(path) else error_body(status, message, param, code)
    return ErrorJSONResponse(body, status_code=status, headers=headers)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A short, readable message; never echoes the (possibly huge) input back."""
    parts, first_param = [], None
    for err in exc.errors()[:_MAX_VALIDATION_ERRORS]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        first_param = first_param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg', 'invalid value')}")
    extra = len(exc.errors()) - _MAX_VALIDATION_ERRORS
    if extra > 0:
        parts.append(f"... and {extra} more")
    return "Invalid request: " + "; ".join(parts), first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI would answer 422; OpenAI clients expect 400 for a malformed request.
        message, param = _validation_message(exc)
        return error_response(400, message, param, path=request.url.path)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, path=request.url.path)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc) or "Invalid request.", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None), path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request", exc_info=exc)
        return error_response(500, "Internal server error.", path=request.url.path)
