"""Server-sent events (the chunk format) and client-disconnect handling.

A client that goes away must abort its request so the engine frees its KV blocks. Streams race their
response against `http.disconnect` (server/stream_response.py); for plain responses, `await_or_disconnect`
does the same race around the wait.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.types import Receive

from server.errors import ClientDisconnected

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


# msgspec writes compact UTF-8 JSON several times faster than json.dumps, and a NaN as null, never as the
# invalid `NaN` (logprobs are clamped before this anyway). Events are bytes from here to the socket.
dumps = msgspec.json.Encoder().encode


def sse_event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ChunkFormat:
    """Serialises stream chunks that share id/object/created/model; the shared head is encoded once.

    text_choice: the endpoint's choice object in its most common chunk (new text, no logprobs, not
    finished) as a %-template of the index and the JSON-encoded text, so that this chunk, one per token,
    is built without a dict (`text_event`); it must encode exactly as `event` would encode that choice."""

    def __init__(self, response_id: str, obj: str, created: int, model: str, text_choice: bytes = b"") -> None:
        head = dumps({"id": response_id, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":['
        self._text_choice = text_choice

    def event(self, choice: dict[str, Any]) -> bytes:
        return b"".join((self._head, dumps(choice), b"]}\n\n"))

    def text_event(self, index: int, text: str) -> bytes:
        return b"".join((self._head, self._text_choice % (index, dumps(text)), b"]}\n\n"))

    def usage_event(self, usage: dict[str, int]) -> bytes:
        return b"".join((self._head, b'],"usage":', dumps(usage), b"}\n\n"))


async def await_or_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`; if the client disconnects first, cancels it and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        listener.cancel()
        raise
    listener.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()
