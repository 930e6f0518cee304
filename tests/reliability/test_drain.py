"""SIGTERM drains: /health and new requests get 503 at once (the port stays open), a request that can finish
within --drain-timeout finishes, those that cannot end with finish_reason "abort" (a stream with a last chunk
and [DONE], a plain request with its partial text), and both processes (the front end, and the engine it shuts down) exit 0."""
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import Outcome, engine_pid, first_events, long_body, post, wait_gone
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.openapi import assert_valid

# The long requests (two of 16 samples x 480 tokens, about 1 s of engine work at the fastest seen here,
# 15,000 tok/s on a quiet machine) cannot finish within it; the short one (8 tokens) easily does.
DRAIN_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    # 40 sequences: the two long requests (16 samples each) leave room for the short one.
    proc = start_server(tiny_checkpoint, "--max-model-len", "512", "--max-num-seqs", "40",
                        "--drain-timeout", str(DRAIN_TIMEOUT_S))
    yield proc
    proc.stop()


async def _drain(server) -> tuple[list[Outcome], list[int], float]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
        started = asyncio.Event()
        long_stream = asyncio.create_task(first_events(client, long_body(), 1, started))
        long_plain = asyncio.create_task(post(client, "/v1/completions", long_body()))
        await asyncio.wait_for(started.wait(), 20)
        short = asyncio.create_task(post(client, "/v1/completions", long_body(max_tokens=8, n=1), stream=True))
        await asyncio.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = await _refusals(server.base_url)
        outcomes = [await long_stream, await long_plain, await short]
        return outcomes, refused, signalled


async def _refusals(base_url: str) -> list[int]:
    """While draining: /health, then a new request, on fresh connections; both must be 503."""
    statuses = []
    async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as fresh:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S / 2
        while time.monotonic() < deadline:      # the signal is handled within uvicorn's 0.1 s tick
            health = await fresh.get("/health")
            if health.status_code == 503:
                break
            await asyncio.sleep(0.02)
        statuses.append(health.status_code)
        assert_valid(health.json(), "ErrorResponse")
        new = await fresh.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        statuses.append(new.status_code)
        assert_valid(new.json(), "ErrorResponse")
        assert "shutting down" in new.json()["error"]["message"]
    return statuses


def _finish_reasons(outcome: Outcome) -> dict[int, str]:
    if not outcome.streamed:
        return {c["index"]: c["finish_reason"] for c in outcome.json()["choices"]}
    reasons = {}
    for event in outcome.events():
        assert "error" not in event
        for choice in event["choices"]:
            reasons[choice["index"]] = choice["finish_reason"]
    return reasons


def test_sigterm_drains_then_aborts_and_exits_zero(server) -> None:
    engine = engine_pid(server)
    (long_stream, long_plain, short), refused, signalled = asyncio.run(_drain(server))
    assert refused == [503, 503]
    # What could finish within the drain timeout did; the rest was cut at the timeout, with "abort".
    assert short.status == 200 and _finish_reasons(short) == {0: "length"}
    assert long_stream.status == 200 and _finish_reasons(long_stream) == {i: "abort" for i in range(16)}
    assert long_plain.status == 200 and _finish_reasons(long_plain) == {i: "abort" for i in range(16)}
    partial = long_plain.json()
    assert 0 < partial["usage"]["completion_tokens"] < 16 * 480
    assert server.proc.wait(timeout=30) == 0
    assert wait_gone(engine, timeout=1.0) < 1.0        # the engine process was shut down, not orphaned
    assert DRAIN_TIMEOUT_S <= time.monotonic() - signalled < DRAIN_TIMEOUT_S + 8
    log = server.log_tail(200_000)
    assert "Traceback" not in log and "drain timeout: aborting 2 request(s)" in log
