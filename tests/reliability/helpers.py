"""Small clients for the reliability tests: asyncio, so that hundreds of requests cost one thread."""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine.faults import SLOW_STEP_S
from tests.server.conftest import MODEL_NAME
from tests.server.prom import GUARD_S, parse
from tests.server.sse import parse_sse

FAULTS = {"PAGEDSERVE_ENABLE_FAULT_INJECTION": "1"}     # the server's env for the /_fault routes


def long_body(max_tokens: int = 480, n: int = 16, **extra: Any) -> dict[str, Any]:
    """n samples of max_tokens, eos ignored: max_tokens engine steps. That is long only by construction,
    under /_fault/slow (at least max_tokens x SLOW_STEP_S) or /_fault/hold (never done until released)."""
    return {"model": MODEL_NAME, "prompt": [7, 8, 9, 10], "max_tokens": max_tokens, "n": n, "ignore_eos": True,
            "temperature": 0.0, **extra}


def min_seconds(max_tokens: int) -> float:
    """The least time a request of max_tokens takes under /_fault/slow: one step per token."""
    return max_tokens * SLOW_STEP_S


def fault(http: httpx.Client, kind: str) -> None:
    """Arms a fault (engine/faults.py): forward, nan, kill once; hold, slow until release; release."""
    assert http.post(f"/_fault/{kind}").json() == {"armed": kind}


async def fault_async(client: httpx.AsyncClient, kind: str) -> None:
    assert (await client.post(f"/_fault/{kind}")).json() == {"armed": kind}


async def metrics_async(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return parse(response.text)


async def wait_for_metrics(client: httpx.AsyncClient, ok: Callable[[dict[str, float]], bool], what: str,
                           timeout: float = GUARD_S) -> dict[str, float]:
    """Polls /metrics until `ok(samples)`; fails the test after `timeout` (a guard against hanging)."""
    deadline = time.monotonic() + timeout
    while not ok(samples := await metrics_async(client)):
        assert time.monotonic() < deadline, f"not {what} after {timeout} s: {samples}"
        await asyncio.sleep(0.02)
    return samples


def gauges(samples: dict[str, float]) -> tuple[float, float]:
    """(running, waiting) requests in the engine, as of its last reported step."""
    return samples["pagedserve_num_requests_running"], samples["pagedserve_num_requests_waiting"]


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


async def refused_while_full(base_url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, int]:
    """A request to `path` refused with the queue full, and the status of a stream to it that waited and whose
    client left. By construction: one completion runs on a slow engine, then the engine is held, so the
    stream waits until its client leaves (which aborts it) and the second request finds the queue full.
    Needs a server with --max-num-seqs 1 --max-queue-len 1 and fault injection (FAULTS)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S) as client:
        await fault_async(client, "slow")
        running = asyncio.create_task(post(client, "/v1/completions", long_body(max_tokens=200, n=1)))
        await wait_for_metrics(client, lambda m: gauges(m) == (1, 0), "one running")
        await fault_async(client, "hold")
        async with client.stream("POST", path, json={**body, "stream": True}) as waiting:
            await wait_for_metrics(client, lambda m: gauges(m) == (1, 1), "one running, one waiting")
            refused = await client.post(path, json=body)
        # The stream's client left: its request is aborted, though the engine runs no step.
        await wait_for_metrics(client, lambda m: gauges(m) == (1, 0), "the waiting request aborted")
        await fault_async(client, "release")
        assert (await running).status == 200
        return refused, waiting.status_code
