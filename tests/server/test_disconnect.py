"""Clients that go away abort their requests (KV blocks freed); SIGTERM shuts the server down cleanly."""
from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server
from tests.server.prom import scrape, wait_until_idle
from tests.server.sse import parse_sse

SHUTDOWN_TIMEOUT_S = 1.0

LONG = {"model": MODEL_NAME, "prompt": [7, 8, 9, 10], "max_tokens": 240, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    yield proc
    proc.stop()


async def _read_a_little_then_leave(client: httpx.AsyncClient, events_to_read: int) -> int:
    seen = 0
    async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= events_to_read:
                break
    return seen     # leaving the block closes the connection mid-stream


async def _disconnect_streams(base_url: str, count: int) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        return await asyncio.gather(*(_read_a_little_then_leave(client, 3) for _ in range(count)))


def test_disconnected_streams_free_their_kv_blocks(server, http: httpx.Client) -> None:
    before = scrape(http)
    kv_baseline = before["pagedserve_kv_cache_usage_perc"]
    assert asyncio.run(_disconnect_streams(server.base_url, 20)) == [3] * 20
    after = wait_until_idle(http, kv_baseline)
    assert after["pagedserve_num_requests_running"] == 0 and after["pagedserve_num_requests_waiting"] == 0
    assert after["pagedserve_kv_cache_usage_perc"] == kv_baseline
    aborted = after["pagedserve_request_success_total{abort}"] - before["pagedserve_request_success_total{abort}"]
    assert aborted == 20
    generated = after["pagedserve_generation_tokens_total"] - before["pagedserve_generation_tokens_total"]
    assert generated < 20 * LONG["max_tokens"] / 2, "the engine went on generating for clients that had left"
    # And it serves a fresh request at once.
    response = http.post("/v1/completions", json={**LONG, "max_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_disconnected_non_streaming_request_is_aborted(server, http: httpx.Client) -> None:
    before = scrape(http)
    body = {**LONG, "n": 32}      # slow enough that the client gives up long before the end
    start = time.monotonic()
    try:
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.3)
        raise AssertionError("the request finished before the client timed out; make it longer")
    except httpx.ReadTimeout:
        pass
    after = wait_until_idle(http, before["pagedserve_kv_cache_usage_perc"])
    assert time.monotonic() - start < 10
    assert after["pagedserve_request_success_total{abort}"] - before["pagedserve_request_success_total{abort}"] == 1
    assert after["pagedserve_request_success_total{length}"] == before["pagedserve_request_success_total{length}"]


def test_sigterm_drains_and_stops_the_server(server) -> None:
    """Last in this module: the module's server is gone afterwards. A stream still running when the
    shutdown timeout runs out ends with an error event and [DONE], not a cut connection."""
    received: dict[str, str] = {}

    def long_stream() -> None:
        body = {**LONG, "n": 32, "max_tokens": 250, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            received["body"] = response.read().decode()

    reader = threading.Thread(target=long_stream)
    reader.start()
    time.sleep(0.5)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal: exit status 0 or "killed by SIGTERM".
    assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 10
    reader.join(timeout=30)
    events = parse_sse(received["body"])
    assert events[-1]["error"]["type"] == "service_unavailable"
    log = server.log_tail(20000)
    assert "Application shutdown complete" in log and "Traceback" not in log
