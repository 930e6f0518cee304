"""The front end and the engine are two processes; each outlives the other's failure correctly. Real
processes, real signals:
  - the engine process SIGKILLed: every open request fails (a 500 envelope, or an SSE error event then
    [DONE]), /health answers 503 until the server exits, with status 1;
  - the front end SIGKILLed: the engine process exits on its own (no orphan holding the device);
  - a live but stuck engine (--engine-stall-timeout): /health answers 503 and the stall is logged while it
    lasts, and 200 again once steps resume; the request still completes.
SIGTERM (both processes drain and exit) is in test_drain.py, a failed engine start in tests/server/test_cli.py.
The requests are in flight at the kill by construction: started on a slow engine, then held (/_fault/hold).
"""
from __future__ import annotations

import asyncio
import os
import signal

import httpx

from tests.reliability.helpers import (
    FAULTS,
    engine_pid,
    fault_async,
    first_events,
    gauges,
    long_body,
    metrics_async,
    post,
    wait_for_metrics,
    wait_gone,
)
from tests.reliability.test_engine_faults import check_failed
from tests.server.conftest import start_server
from tests.server.openapi import assert_valid
from tests.server.prom import GUARD_S


async def _open_requests(base_url: str, kill) -> list:
    """A stream (past its first event) and two plain requests running on a held engine; then `kill()`.
    Returns the outcomes (an exception where a client got no answer)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S) as client:
        await fault_async(client, "slow")       # 300 tokens take 15 s at least: they are running when held
        started = asyncio.Event()
        stream = asyncio.create_task(first_events(client, long_body(max_tokens=300, n=2), 1, started))
        plain = [asyncio.create_task(post(client, "/v1/completions", long_body(max_tokens=300, n=2)))
                 for _ in range(2)]
        await asyncio.wait_for(started.wait(), GUARD_S)
        await wait_for_metrics(client, lambda m: gauges(m) == (3, 0), "3 running")
        await fault_async(client, "hold")
        assert gauges(await metrics_async(client)) == (3, 0)
        assert not stream.done() and not any(task.done() for task in plain)
        kill()
        return list(await asyncio.gather(stream, *plain, return_exceptions=True))


def test_engine_killed_fails_every_request_and_the_server_exits_1(tiny_checkpoint) -> None:
    server = start_server(tiny_checkpoint, "--max-model-len", "512", env=FAULTS)
    try:
        pid = engine_pid(server)
        outcomes = asyncio.run(_open_requests(server.base_url, lambda: os.kill(pid, signal.SIGKILL)))
        for outcome in outcomes:
            check_failed(outcome, 500)
        # 503 until the server exits (about a second later), then a closed port: which one a client sees
        # depends on its speed. (tests/server/test_bridge.py checks the 503 in-process.)
        try:
            health = httpx.get(server.base_url + "/health", timeout=GUARD_S)
            assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
            assert_valid(health.json(), "ErrorResponse")
        except httpx.TransportError:
            pass
        assert server.proc.wait(timeout=GUARD_S) == 1
        log = server.log_tail(200_000)
        assert "the engine died" in log and "exited with status -9" in log
    finally:
        server.stop()


def test_front_end_killed_takes_the_engine_with_it(tiny_checkpoint) -> None:
    server = start_server(tiny_checkpoint, "--max-model-len", "512", env=FAULTS)
    try:
        pid = engine_pid(server)
        outcomes = asyncio.run(_open_requests(server.base_url, lambda: server.proc.send_signal(signal.SIGKILL)))
        assert all(isinstance(o, httpx.TransportError) for o in outcomes), outcomes   # cut without an answer
        wait_gone(pid, timeout=GUARD_S)
        assert "the front end (pid" in server.log_tail(200_000)     # it saw its parent go, and left
    finally:
        server.stop()


def test_a_stuck_engine_turns_health_503_until_it_steps_again(tiny_checkpoint) -> None:
    """The engine is held (it completes no step) from before the request until the test has seen /health
    turn 503; then released."""
    server = start_server(tiny_checkpoint, "--engine-stall-timeout", "1", env=FAULTS)
    try:
        with httpx.Client(base_url=server.base_url, timeout=GUARD_S) as http:
            body = {"model": "tiny-test", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}

            async def run() -> tuple[list[int], int]:
                async with httpx.AsyncClient(base_url=server.base_url, timeout=GUARD_S) as client:
                    statuses = [(await client.get("/health")).status_code]
                    await fault_async(client, "hold")
                    request = asyncio.create_task(client.post("/v1/completions", json=body))
                    while statuses[-1] != 503:
                        assert not request.done() and len(statuses) < GUARD_S / 0.05, statuses
                        await asyncio.sleep(0.05)
                        statuses.append((await client.get("/health")).status_code)
                    await fault_async(client, "release")
                    return statuses, (await request).status_code

            statuses, status = asyncio.run(run())
            assert statuses[0] == 200 and statuses[-1] == 503 and status == 200
            assert http.get("/health").status_code == 200
        log = server.log_tail(200_000)
        assert "the engine looks stuck" in log and "no longer stuck" in log
    finally:
        server.stop()
