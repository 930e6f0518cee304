"""Streamed generations: each engine step's news is pushed to every stream's response at once.

One engine step brings news for up to hundreds of streams. Waking one consumer task per stream per token
costs a task switch, a future and a chain of coroutine resumptions each time, and writing each stream's
chunk as soon as it is rendered spaces the socket writes out, so that a local reader is woken (and the
write pays for it) once per chunk. Instead the bridge routes a step's tokens to the streams, and one
`StepWriter` pass then renders every stream with news (detokenize, stop strings, the SSE chunk) and writes
the chunks back to back.

A response's own task only waits for the end or the client's disconnect (which aborts the request). A
write that cannot complete at once (the client reads slower than tokens come) is finished by a task of its
own; meanwhile that stream's news stays in its inbox and goes out merged into one chunk when the write is
done, so a slow client gets fewer, bigger chunks and never holds up the others.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from server.errors import error_body
from server.generation import ChoiceDelta, GenerationError, GenerationStream
from server.protocol import usage_dict
from server.sse import DONE, SSE_HEADERS, ChunkFormat, sse_event, wait_for_disconnect


@dataclass
class ChoiceEvents:
    """How a stream's news becomes SSE events: `with_first_update` (chat's role chunks) in front of the
    first update, what `render` makes of each choice update (b"" for none),
    the usage chunk at the end when `usage` is given, then [DONE]. A failure after the stream started is
    reported in-band, as an error event."""
    render: Callable[[ChoiceDelta], bytes]
    usage: ChunkFormat | None = None
    with_first_update: bytes = b""
    # An endpoint with its own framing (Anthropic's Messages): the last bytes instead of the usage chunk
    # and [DONE], and its own in-band error event.
    end: Callable[[], bytes] | None = None
    error: Callable[[GenerationError], bytes] | None = None


class StepWriter:
    """Renders, then writes, every stream that got news since its last pass; one pass per event-loop turn."""

    def __init__(self) -> None:
        self._marked: list[SSEResponse] = []
        self._scheduled = False

    def mark(self, response: SSEResponse) -> None:
        self._marked.append(response)
        if not self._scheduled:
            self._scheduled = True
            # A task, not a bare callback: the servers' `send` may ask which task it runs in (anyio does).
            asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        self._scheduled = False
        marked, self._marked = self._marked, []
        pieces = [response.take_events() for response in marked]
        for response, piece in zip(marked, pieces):
            response.write(piece)


class SSEResponse(Response):
    def __init__(self, stream: GenerationStream, events: ChoiceEvents, writer: StepWriter) -> None:
        self.status_code = 200
        self.background = None
        self._stream, self._events, self._writer = stream, events, writer
        self._send: Send | None = None
        self._pending_first = events.with_first_update
        self._last = False                          # the final piece is rendered
        self._writing: asyncio.Task | None = None   # a write waiting for a slow client
        self._done: asyncio.Future | None = None    # the response ended (or failed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        self._done = done = asyncio.get_running_loop().create_future()
        listener = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            self._stream.push = self._news
            if self._stream.ready:          # news that came before the response started
                self._news()
            await asyncio.wait({done, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            self._stream.push = None
            if not done.done():
                done.cancel()               # ended early (client gone, server shutdown): nothing more goes out
            if self._writing is not None:
                self._writing.cancel()
            self._stream.close()            # and the engine requests still running are aborted now
        if not done.cancelled() and done.exception() is not None:
            raise done.exception()

    def _news(self) -> None:
        if self._writing is None and not _ended(self._done):
            self._writer.mark(self)

    def take_events(self) -> bytes:
        """The events for the stream's news since the last render (b"" if none make a chunk)."""
        if self._writing is not None or _ended(self._done):
            return b""                      # a slow client: the news waits in the stream's inbox
        try:
            return self._render()
        except Exception as exc:            # a defect, not the client's: fail this response only
            self._done.set_exception(exc)
            return b""

    def _render(self) -> bytes:
        stream, events = self._stream, self._events
        try:
            deltas = stream.take()
            piece = b""
            if deltas:
                piece = self._pending_first + b"".join([events.render(d) for d in deltas])
                self._pending_first = b""
            if not stream.finished:
                return piece
            if events.end is not None:
                self._last = True
                return piece + events.end()
            if events.usage is not None:
                piece += events.usage.usage_event(usage_dict(stream.num_prompt_tokens, stream.num_completion_tokens))
        except GenerationError as exc:
            self._last = True
            if events.error is not None:
                return events.error(exc)
            piece = sse_event(error_body(exc.status, f"Generation failed: {exc}."))
        self._last = True
        return piece + DONE

    def write(self, piece: bytes) -> None:
        if _ended(self._done) or not (piece or self._last):
            return
        message = {"type": "http.response.body", "body": piece, "more_body": not self._last}
        try:
            self._writing = send_now(self._send, message)
        except Exception as exc:            # e.g. the connection is gone
            self._done.set_exception(exc)
            return
        if self._writing is not None:
            self._writing.add_done_callback(self._written)
        elif self._last:
            self._done.set_result(None)

    def _written(self, task: asyncio.Task) -> None:
        self._writing = None
        if _ended(self._done):
            return
        if task.cancelled():
            self._done.set_exception(ConnectionError("the write was cancelled"))
        elif task.exception() is not None:
            self._done.set_exception(task.exception())
        elif self._last:
            self._done.set_result(None)
        elif self._stream.ready:            # news came while the client was behind
            self._writer.mark(self)


def _ended(future: asyncio.Future | None) -> bool:
    return future is None or future.done()


def send_now(send: Send, message: Message) -> asyncio.Task | None:
    """Runs `send(message)` now. uvicorn's send completes without suspending unless the client is behind
    (it waits for the socket to drain): then a task finishes it, and is returned."""
    coro = send(message)
    try:
        blocker = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_finish(coro, blocker))


async def _finish(coro: Coroutine[Any, Any, None], blocker: Any) -> None:
    """Drives a coroutine that suspended on `blocker` (a future, or None for a bare yield) to its end, as a
    task would: it cannot simply be awaited, being suspended inside an await already."""
    try:
        while True:
            if blocker is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait({blocker})     # its outcome goes to the coroutine, not raised here
            blocker = coro.send(None)
    except StopIteration:
        return
    finally:
        coro.close()
