"""Server-sent events and client-disconnect handling.

A client that goes away must abort its request so the engine frees its KV blocks. For streams, the
response races the body against `http.disconnect` and always closes the body generator (whose `finally`
aborts the request). For plain responses, `await_or_disconnect` does the same race around the wait.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.errors import ClientDisconnected, error_body
from server.generation import ChoiceDelta, GenerationError, GenerationStream
from server.protocol import usage_dict

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


# msgspec writes compact UTF-8 JSON several times faster than json.dumps, and a NaN as null, never as the
# invalid `NaN` (logprobs are clamped before this anyway). Events are bytes from here to the socket.
dumps = msgspec.json.Encoder().encode


def sse_event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
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


async def choice_events(stream: GenerationStream, render: Callable[[ChoiceDelta], bytes], usage: ChunkFormat | None,
                        first: bytes = b"", with_first_update: bytes = b"") -> AsyncIterator[bytes]:
    """The body of a completions or chat stream: `first` (echo chunks) at once, `with_first_update` (chat's
    role chunks) in front of the first update, the events `render` makes of each choice update (b"" for
    none), the usage chunk when `usage` is given, then [DONE]. A failure after the stream started is
    reported in-band, as an error event."""
    try:
        if first:
            yield first
        pending = with_first_update
        while not stream.finished:
            waiter = stream.news()
            if waiter is not None:
                await waiter
            deltas = stream.take()
            if deltas:
                yield pending + b"".join([render(d) for d in deltas])
                pending = b""
        if usage is not None:
            yield usage.usage_event(usage_dict(stream.num_prompt_tokens, stream.num_completion_tokens))
    except GenerationError as exc:
        yield sse_event(error_body(exc.status, f"Generation failed: {exc}."))
    finally:
        # Ended early (client gone, error): abort the engine requests now.
        stream.close()
    yield DONE


class SSEResponse(Response):
    """Streams `data: ...` events from an async iterator of bytes; a disconnect closes the iterator."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self._events = body
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            sender.cancel()
            await asyncio.gather(sender, listener, return_exceptions=True)
            # Runs the body's `finally` (the abort) even if it never started or was cancelled mid-wait.
            await self._events.aclose()
        if not sender.cancelled() and sender.exception() is not None:
            raise sender.exception()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        async for piece in self._events:
            if piece:
                # One engine step wakes every stream at once. Yielding one loop pass here lets all of them
                # render first and then write back to back: on a local client, a write spaced out by
                # rendering wakes the reader each time, and that wake-up costs the writer 2-3x the write.
                await asyncio.sleep(0)
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def await_or_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`; if the client disconnects first, cancels it and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
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
