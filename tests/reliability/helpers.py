"""Small clients for the reliability tests: asyncio, so that hundreds of requests cost one thread."""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import MODEL_NAME
from tests.server.sse import parse_sse


def long_body(max_tokens: int = 480, n: int = 16, **extra: Any) -> dict[str, Any]:
    """A request that keeps the engine busy for seconds on CPU (n samples of max_tokens, eos ignored)."""
    return {"model": MODEL_NAME, "prompt": [7, 8, 9, 10], "max_tokens": max_tokens, "n": n, "ignore_eos": True,
            "temperature": 0.0, **extra}


@dataclass
class Outcome:
    status: int
    text: str
    headers: httpx.Headers
    elapsed: float
    streamed: bool

    def json(self) -> Any:
        return json.loads(self.text)

    def events(self) -> list[Any]:
        return parse_sse(self.text)


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any], stream: bool = False) -> Outcome:
    """One request to the end; a stream is read whole (its status is known before any event)."""
    start = time.monotonic()
    if not stream:
        r = await client.post(path, json=body)
        return Outcome(r.status_code, r.text, r.headers, time.monotonic() - start, False)
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        text = (await r.aread()).decode()
    return Outcome(r.status_code, text, r.headers, time.monotonic() - start, True)


async def first_events(client: httpx.AsyncClient, body: dict[str, Any], count: int,
                       started: asyncio.Event | None = None) -> Outcome:
    """Streams `body`, sets `started` after the first event, reads to the end; returns everything read."""
    start, lines = time.monotonic(), []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        seen = 0
        async for line in r.aiter_lines():
            lines.append(line)
            seen += line.startswith("data: ")
            if started is not None and seen == count:
                started.set()
    text = "".join(line + "\n" for line in lines)
    return Outcome(r.status_code, text, r.headers, time.monotonic() - start, True)


def engine_pid(server) -> int:
    """The engine process's pid, from the line the server logs once the engine is ready."""
    match = re.search(r"engine process pid (\d+)", server.log_tail(200_000))
    assert match, server.log_tail()
    return int(match.group(1))


def process_gone(pid: int) -> bool:
    """Exited (a zombie nobody has reaped yet counts as exited: it holds no memory and runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> float:
    """Seconds until `pid` exited; fails the test after `timeout`."""
    start = time.monotonic()
    while not process_gone(pid):
        assert time.monotonic() - start < timeout, f"process {pid} still running after {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - start
