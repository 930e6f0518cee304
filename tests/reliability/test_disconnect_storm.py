"""Clients that go away abort their requests, streaming or not, however many leave at once: afterwards nothing
runs or waits, the KV cache is back at its baseline, the engine stopped generating for them, and a normal
request completes at once.

The engine runs slowly (/_fault/slow) during the storm, so that no request can finish before its client has
left: each needs MAX_TOKENS steps, far more time than the storm takes. Once every client has gone the engine
is held (/_fault/hold): it runs no step, so only the aborts can empty it."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import FAULTS, fault, long_body, min_seconds
from tests.server.conftest import start_server
from tests.server.prom import GUARD_S, is_idle, scrape, wait_until_idle

NUM_STREAMS, NUM_PLAIN = 200, 50
MAX_TOKENS = 500        # 25 s at least on the slow engine
PLAIN_READ_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-queue-len", "1000", "--max-model-len", "512", env=FAULTS)
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
    is not cancelled by a disconnect unless it listens for one). The read timeout fires: the request needs
    MAX_TOKENS slow steps."""
    try:
        await client.post("/v1/completions", json=long_body(max_tokens=MAX_TOKENS, n=4),
                          timeout=httpx.Timeout(GUARD_S, read=PLAIN_READ_TIMEOUT_S))
    except httpx.ReadTimeout:
        return "gave up"
    return "finished"


async def _storm(base_url: str) -> tuple[list[int], list[str]]:
    limits = httpx.Limits(max_connections=NUM_STREAMS + NUM_PLAIN + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S, limits=limits) as client:
        streams = asyncio.gather(*(_read_then_leave(client, 1 + i % 3) for i in range(NUM_STREAMS)))
        plain = asyncio.gather(*(_give_up_waiting(client) for _ in range(NUM_PLAIN)))
        return await streams, await plain


def test_disconnect_storm_leaves_nothing_behind(server, http: httpx.Client) -> None:
    assert min_seconds(MAX_TOKENS) > 20 * PLAIN_READ_TIMEOUT_S
    before = scrape(http)
    kv_baseline = before["pagedserve_kv_cache_usage_perc"]
    fault(http, "slow")
    seen, plain = asyncio.run(_storm(server.base_url))
    fault(http, "hold")         # no more steps: nothing can finish now, only the aborts can empty the engine
    assert seen == [1 + i % 3 for i in range(NUM_STREAMS)]
    assert plain == ["gave up"] * NUM_PLAIN
    after = wait_until_idle(http, kv_baseline)
    fault(http, "release")
    assert is_idle(after, kv_baseline), "the engine went on holding requests of clients that had left"
    grew = {reason: after[f"pagedserve_request_success_total{{{reason}}}"]
            - before[f"pagedserve_request_success_total{{{reason}}}"] for reason in ("abort", "stop", "length", "error")}
    assert grew == {"abort": NUM_STREAMS + NUM_PLAIN, "stop": 0, "length": 0, "error": 0}
    # And the server serves a fresh request.
    response = http.post("/v1/completions", json=long_body(max_tokens=3, n=1))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log_tail(200_000)
