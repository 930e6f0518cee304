"""Clients that go away abort their requests, streaming or not, however many leave at once: afterwards nothing
runs or waits, the KV cache is back at its baseline, the engine stopped generating for them, and a normal
request completes at once."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import long_body
from tests.server.conftest import start_server
from tests.server.prom import scrape, wait_until_idle

NUM_STREAMS, NUM_PLAIN = 200, 50
MAX_TOKENS = 240


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-queue-len", "1000")
    yield proc
    proc.stop()


async def _read_then_leave(client: httpx.AsyncClient, events_to_read: int) -> int:
    seen = 0
    body = long_body(max_tokens=MAX_TOKENS, n=1, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= events_to_read:
                break
    return seen     # leaving the block closes the connection mid-stream


async def _give_up_waiting(client: httpx.AsyncClient) -> str:
    """A plain request whose client stops waiting long before the answer (the Starlette trap: a plain handler
    is not cancelled by a disconnect unless it listens for one)."""
    try:
        await client.post("/v1/completions", json=long_body(max_tokens=MAX_TOKENS, n=4),
                          timeout=httpx.Timeout(30.0, read=0.5))
    except httpx.ReadTimeout:
        return "gave up"
    return "finished"


async def _storm(base_url: str) -> tuple[list[int], list[str]]:
    limits = httpx.Limits(max_connections=NUM_STREAMS + NUM_PLAIN + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0, limits=limits) as client:
        streams = asyncio.gather(*(_read_then_leave(client, 1 + i % 3) for i in range(NUM_STREAMS)))
        plain = asyncio.gather(*(_give_up_waiting(client) for _ in range(NUM_PLAIN)))
        return await streams, await plain


def test_disconnect_storm_leaves_nothing_behind(server, http: httpx.Client) -> None:
    before = scrape(http)
    kv_baseline = before["pagedserve_kv_cache_usage_perc"]
    start = time.monotonic()
    seen, plain = asyncio.run(_storm(server.base_url))
    assert seen == [1 + i % 3 for i in range(NUM_STREAMS)]
    assert plain == ["gave up"] * NUM_PLAIN
    left = time.monotonic()
    after = wait_until_idle(http, kv_baseline, timeout=30.0)
    # Finishing what they asked for would take the engine well over 10 s; aborting takes a step or two.
    assert time.monotonic() - left < 5.0, "the engine went on generating for clients that had left"
    assert after["pagedserve_num_requests_running"] == 0 and after["pagedserve_num_requests_waiting"] == 0
    assert after["pagedserve_kv_cache_usage_perc"] == kv_baseline
    aborted = after["pagedserve_request_success_total{abort}"] - before["pagedserve_request_success_total{abort}"]
    assert aborted == NUM_STREAMS + NUM_PLAIN
    finished = sum(after[f"pagedserve_request_success_total{{{r}}}"] - before[f"pagedserve_request_success_total{{{r}}}"]
                   for r in ("stop", "length", "error"))
    assert finished == 0
    assert time.monotonic() - start < 60
    # And the server serves a fresh request at once.
    response = http.post("/v1/completions", json=long_body(max_tokens=3, n=1), timeout=10.0)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log_tail(200_000)
