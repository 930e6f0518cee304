"""Streamed responses pushed per engine step (server/stream_response.py): a client that reads slowly gets its
news merged into fewer chunks and never holds up the other streams; `send_now` finishes a send that has to
wait, as a task would. In-process, with the test playing the engine."""
from __future__ import annotations

import asyncio
import json

from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta
from server.stream_response import send_now
from tests.server.fakes import asgi_post, loop_turns, scripted_app
from tests.server.sse import parse_sse

WORDS = [" one", " two", " three", " four", " five", " six"]


class Recorder:
    """An ASGI `send` that records the body; with `hold_from` set, the write of that body chunk (counting
    from 0) and every later one wait until `gate` opens, as for a client that stopped reading."""

    def __init__(self, hold_from: int | None = None) -> None:
        self.chunks: list[bytes] = []
        self.gate = asyncio.Event()
        self.hold_from = hold_from

    async def send(self, message: dict) -> None:
        if message["type"] != "http.response.body":
            return
        if self.hold_from is not None and len(self.chunks) >= self.hold_from:
            await self.gate.wait()
        self.chunks.append(message["body"])

    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in parse_sse(b"".join(self.chunks).decode()) if e["choices"])


async def _slow_and_fast_streams() -> tuple[Recorder, Recorder, list[int]]:
    app, [client] = scripted_app()
    await app.state.ctx.async_engine.start()
    slow, fast = Recorder(hold_from=1), Recorder()
    body = json.dumps({"prompt": "hi", "max_tokens": len(WORDS), "stream": True}).encode()
    tasks = [asyncio.ensure_future(asgi_post(app, "/v1/completions", body, r.send)) for r in (slow, fast)]
    await loop_turns()
    requests = [client.added.get_nowait() for _ in range(2)]
    token_ids = [client.tokenizer.encode(w, add_special_tokens=False) for w in WORDS]
    fast_chunks_per_step = []
    for step, ids in enumerate(token_ids):
        if step == 4:
            slow.gate.set()       # the slow client reads again
        last = step == len(token_ids) - 1
        deltas = [RequestDelta(rid, [SequenceDelta(0, ids, None, "length" if last else None)], last, len(prompt), 0,
                               RequestTimings(arrival or 0.0)) for rid, prompt, _, arrival in requests]
        client.deliver(deltas, EngineStats(num_running=2))
        await loop_turns()
        fast_chunks_per_step.append(len(fast.chunks))
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return slow, fast, fast_chunks_per_step


def test_a_slow_client_gets_merged_chunks_and_holds_up_nobody() -> None:
    slow, fast, fast_chunks_per_step = asyncio.run(_slow_and_fast_streams())
    full = "".join(WORDS)
    assert fast.text() == full and slow.text() == full
    assert fast_chunks_per_step == [1, 2, 3, 4, 5, 6]     # one chunk per step, also while the other is stuck
    assert fast.chunks[-1].endswith(b"data: [DONE]\n\n") and slow.chunks[-1].endswith(b"data: [DONE]\n\n")
    # The slow client's second chunk was stuck in its write; what came meanwhile went out as one chunk.
    assert len(slow.chunks) == 4
    assert b'"text":" three four five"' in slow.chunks[2]


async def _send_now_cases() -> dict[str, object]:
    """Runs send_now on four kinds of send; returns what was observed, for the test to check."""
    seen: dict[str, object] = {}
    log: list[str] = []

    async def immediate(message: str) -> None:
        log.append(message)

    seen["immediate task"] = send_now(immediate, "a")
    seen["log after immediate"] = list(log)

    gate = asyncio.get_running_loop().create_future()

    async def waits(message: str) -> None:
        log.append(await gate + message)

    task = send_now(waits, "b")
    seen["waiting task pending"] = task is not None and not task.done()
    gate.set_result(">")
    await task
    seen["log after waiting"] = list(log)

    failing = asyncio.get_running_loop().create_future()

    async def fails(message: str) -> None:
        await failing

    task = send_now(fails, "c")
    failing.set_exception(ConnectionResetError("gone"))
    seen["failure"] = type((await asyncio.gather(task, return_exceptions=True))[0])

    closed: list[bool] = []

    async def never(message: str) -> None:
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            closed.append(True)

    task = send_now(never, "d")
    await loop_turns(2)
    task.cancel()
    seen["cancelled"] = isinstance((await asyncio.gather(task, return_exceptions=True))[0], asyncio.CancelledError)
    seen["closed"] = closed
    return seen


def test_send_now_runs_a_send_to_its_end_as_a_task_would() -> None:
    seen = asyncio.run(_send_now_cases())
    assert seen["immediate task"] is None and seen["log after immediate"] == ["a"]   # done at once, no task
    assert seen["waiting task pending"] and seen["log after waiting"] == ["a", ">b"]
    assert seen["failure"] is ConnectionResetError       # the send's failure is the task's
    assert seen["cancelled"] and seen["closed"] == [True]  # cancelling the task closes the send
