"""The front end and the engine are two processes; each outlives the other's failure correctly. Real
processes, real signals:
  - the engine process SIGKILLed: within a second every open request fails (a 500 envelope, or an SSE error
    event then [DONE]), /health answers 503, and the server exits with status 1;
  - the front end SIGKILLed: the engine process exits on its own within 5 s (no orphan holding the device);
  - a live but stuck engine (--engine-stall-timeout): /health answers 503 and the stall is logged while it
    lasts, and 200 again once steps resume; the request still completes.
SIGTERM (both processes drain and exit) is in test_drain.py, a failed engine start in tests/server/test_cli.py.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from tests.reliability.helpers import engine_pid, first_events, long_body, post, wait_gone
from tests.reliability.test_engine_faults import check_failed
from tests.server.conftest import start_server

FAULTS = {"PAGEDSERVE_ENABLE_FAULT_INJECTION": "1"}


async def _open_requests(base_url: str, kill) -> tuple[list, float]:
    """A stream (past its first event) and two plain requests in flight; then `kill()`. Returns the outcomes
    and the seconds from the kill until the last of them was answered."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        started = asyncio.Event()
        stream = asyncio.create_task(first_events(client, long_body(max_tokens=300, n=2), 1, started))
        plain = [asyncio.create_task(post(client, "/v1/completions", long_body(max_tokens=300, n=2)))
                 for _ in range(2)]
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.2)        # the plain requests are in the engine too
        kill()
        killed = time.monotonic()
        outcomes = await asyncio.gather(stream, *plain, return_exceptions=True)
        return list(outcomes), time.monotonic() - killed


def test_engine_killed_fails_every_request_and_the_server_exits_1(tiny_checkpoint) -> None:
    server = start_server(tiny_checkpoint, "--max-model-len", "512")
    try:
        pid = engine_pid(server)
        outcomes, elapsed = asyncio.run(_open_requests(server.base_url, lambda: os.kill(pid, signal.SIGKILL)))
        assert elapsed < 1.0, f"open requests were answered {elapsed:.2f} s after the engine died"
        for outcome in outcomes:
            check_failed(outcome, 500)
        health = httpx.get(server.base_url + "/health", timeout=5.0)
        assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
        assert server.proc.wait(timeout=15) == 1
        log = server.log_tail(200_000)
        assert "the engine died" in log and "exited with status -9" in log
    finally:
        server.stop()


def test_front_end_killed_takes_the_engine_with_it(tiny_checkpoint) -> None:
    server = start_server(tiny_checkpoint, "--max-model-len", "512")
    try:
        pid = engine_pid(server)
        outcomes, _ = asyncio.run(_open_requests(server.base_url, lambda: server.proc.send_signal(signal.SIGKILL)))
        assert all(isinstance(o, httpx.TransportError) for o in outcomes[1:])   # cut without an answer
        assert wait_gone(pid, timeout=5.0) < 5.0
    finally:
        server.stop()


def test_a_stuck_engine_turns_health_503_until_it_steps_again(tiny_checkpoint) -> None:
    server = start_server(tiny_checkpoint, "--engine-stall-timeout", "1", env=FAULTS)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
            assert http.post("/_fault/stall").json() == {"armed": "stall"}      # the next step blocks 3 s
            body = {"model": "tiny-test", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
            statuses: list[int] = []

            async def run() -> int:
                async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
                    request = asyncio.create_task(client.post("/v1/completions", json=body))
                    while not request.done():
                        statuses.append((await client.get("/health")).status_code)
                        await asyncio.sleep(0.1)
                    return (await request).status_code

            assert asyncio.run(run()) == 200
            assert 503 in statuses and statuses[0] == 200
            assert http.get("/health").status_code == 200
        log = server.log_tail(200_000)
        assert "the engine looks stuck" in log and "no longer stuck" in log
    finally:
        server.stop()
