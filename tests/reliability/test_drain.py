"""SIGTERM drains: /health and new requests get 503 at once (the port stays open), a request that can finish
within --drain-timeout finishes, those that cannot end with finish_reason "abort" (a stream with a last chunk
and [DONE], a plain request with its partial text), and both processes (the front end, and the engine it shuts
down) exit 0.

The engine runs slowly (/_fault/slow): the long requests need 480 steps, 24 s at least, so they cannot finish
within the drain timeout, whatever the machine. The short one needs SHORT_TOKENS steps: it finishes within the
drain timeout unless a step takes over half a second (the one speed this test assumes, 20 times over)."""
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import (
    FAULTS,
    Outcome,
    engine_pid,
    fault_async,
    first_events,
    gauges,
    long_body,
    min_seconds,
    post,
    wait_for_metrics,
    wait_gone,
)
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.openapi import assert_valid
from tests.server.prom import GUARD_S

DRAIN_TIMEOUT_S = 10.0
LONG_TOKENS, SHORT_TOKENS = 480, 16


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    # 40 sequences: the two long requests (16 samples each) leave room for the short one.
    proc = start_server(tiny_checkpoint, "--max-model-len", "512", "--max-num-seqs", "40",
                        "--drain-timeout", str(DRAIN_TIMEOUT_S), env=FAULTS)
    yield proc
    proc.stop()


async def _drain(server) -> tuple[list[Outcome], list[int], float]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=GUARD_S) as client:
        await fault_async(client, "slow")
        started, short_started = asyncio.Event(), asyncio.Event()
        long_stream = asyncio.create_task(first_events(client, long_body(LONG_TOKENS), 1, started))
        long_plain = asyncio.create_task(post(client, "/v1/completions", long_body(LONG_TOKENS)))
        await asyncio.wait_for(started.wait(), GUARD_S)
        short = asyncio.create_task(first_events(client, long_body(SHORT_TOKENS, n=1), 1, short_started))
        await asyncio.wait_for(short_started.wait(), GUARD_S)
        await wait_for_metrics(client, lambda m: gauges(m) == (3, 0), "3 running")
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = await _refusals(server.base_url)
        outcomes = [await long_stream, await long_plain, await short]
        return outcomes, refused, time.monotonic() - signalled


async def _refusals(base_url: str) -> list[int]:
    """While draining: /health, then a new request, on fresh connections; both must be 503."""
    statuses = []
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S) as fresh:
        deadline = time.monotonic() + GUARD_S
        while (health := await fresh.get("/health")).status_code != 503 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)           # until uvicorn's next tick has seen the signal
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
    assert min_seconds(LONG_TOKENS - 20) > 2 * DRAIN_TIMEOUT_S
    engine = engine_pid(server)
    (long_stream, long_plain, short), refused, drained = asyncio.run(_drain(server))
    assert refused == [503, 503]
    # What could finish within the drain timeout did; the rest was cut at the timeout, with "abort".
    assert short.status == 200 and _finish_reasons(short) == {0: "length"}
    assert long_stream.status == 200 and _finish_reasons(long_stream) == {i: "abort" for i in range(16)}
    assert long_plain.status == 200 and _finish_reasons(long_plain) == {i: "abort" for i in range(16)}
    partial = long_plain.json()
    assert 0 < partial["usage"]["completion_tokens"] < 16 * LONG_TOKENS
    assert drained >= DRAIN_TIMEOUT_S       # the long ones were given the whole drain timeout
    assert server.proc.wait(timeout=GUARD_S) == 0
    wait_gone(engine, GUARD_S)
    log = server.log_tail(200_000)
    assert "engine process: shutdown requested" in log      # shut down by the front end, not orphaned
    assert "Traceback" not in log and "drain timeout: aborting 2 request(s)" in log
