"""Admission control: 4 x max_queue_len requests at once while max_num_seqs requests run. Exactly max_queue_len
more are admitted (running requests do not count against the queue); the excess is refused with 429 at once (a
real status, before any SSE byte, with Retry-After and the error envelope) while the engine is held, /health
answers meanwhile, and once released every admitted request completes correctly.

By construction, not by speed: the running requests start on a slow engine (/_fault/slow), then the engine is
held (/_fault/hold) so that nothing finishes or starts until the refusals have all been answered."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import (
    FAULTS,
    Outcome,
    fault_async,
    gauges,
    long_body,
    post,
    wait_for_metrics,
)
from tests.server.conftest import start_server
from tests.server.openapi import assert_valid
from tests.server.prom import GUARD_S, scrape, wait_until_idle

MAX_QUEUE_LEN, MAX_NUM_SEQS = 8, 4
MAX_TOKENS = 240        # 12 s at least on the slow engine


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-len", str(MAX_QUEUE_LEN),
                        env=FAULTS)
    yield proc
    proc.stop()


async def _storm(base_url: str) -> tuple[list[Outcome], list[Outcome], dict[str, float], int]:
    """Returns the running requests' outcomes, the storm's, the metrics while the refusals were answered and
    /health's status then."""
    total = 4 * MAX_QUEUE_LEN
    body = long_body(max_tokens=MAX_TOKENS, n=1)
    limits = httpx.Limits(max_connections=total + MAX_NUM_SEQS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S, limits=limits) as client:
        await fault_async(client, "slow")
        running = [asyncio.create_task(post(client, "/v1/completions", body)) for _ in range(MAX_NUM_SEQS)]
        await wait_for_metrics(client, lambda m: gauges(m) == (MAX_NUM_SEQS, 0), f"{MAX_NUM_SEQS} running")
        await fault_async(client, "hold")
        storm = [asyncio.create_task(post(client, "/v1/completions", body, stream=i % 2 == 1)) for i in range(total)]
        refused = total - MAX_QUEUE_LEN
        deadline = asyncio.get_running_loop().time() + GUARD_S
        while sum(task.done() for task in storm) < refused:
            assert asyncio.get_running_loop().time() < deadline, "the excess was not refused"
            await asyncio.sleep(0.02)
        held = await wait_for_metrics(client, lambda m: gauges(m) == (MAX_NUM_SEQS, MAX_QUEUE_LEN),
                                      f"{MAX_NUM_SEQS} running and {MAX_QUEUE_LEN} waiting")
        health = (await client.get("/health")).status_code
        assert not any(task.done() for task in running)
        await fault_async(client, "release")
        return list(await asyncio.gather(*running)), list(await asyncio.gather(*storm)), held, health


def test_excess_is_refused_at_once_and_the_rest_complete(server, http: httpx.Client) -> None:
    before = scrape(http)
    running, outcomes, held, health = asyncio.run(_storm(server.base_url))
    refused = [o for o in outcomes if o.status == 429]
    served = [o for o in outcomes if o.status == 200]
    assert len(refused) + len(served) == len(outcomes), sorted({o.status for o in outcomes})
    assert len(served) == MAX_QUEUE_LEN         # an engine with MAX_NUM_SEQS running takes MAX_QUEUE_LEN more
    assert health == 200
    assert held["pagedserve_num_requests_rejected_total"] - before["pagedserve_num_requests_rejected_total"] == len(refused)
    for o in refused:
        assert not o.text.startswith("data:"), "a refused stream must not start"
        assert o.headers["content-type"].startswith("application/json")
        assert int(o.headers["retry-after"]) >= 1
        assert_valid(o.json(), "ErrorResponse")
        assert o.json()["error"]["type"] == "rate_limit_error"
    for o in served + running:
        if o.streamed:
            events = o.events()
            assert not any("error" in e for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert o.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert wait_until_idle(http, 0.0)["pagedserve_kv_cache_usage_perc"] == 0.0


def test_serial_requests_are_never_throttled(server, http: httpx.Client) -> None:
    idle = wait_until_idle(http, 0.0)
    assert idle["pagedserve_num_requests_running"] == 0 and idle["pagedserve_kv_cache_usage_perc"] == 0.0
    for _ in range(3):
        response = http.post("/v1/completions", json=long_body(max_tokens=4, n=1))
        assert response.status_code == 200
    # A request with more prompts than the queue holds is still taken by an idle server.
    many = http.post("/v1/completions", json={**long_body(max_tokens=2, n=1), "prompt": [[5, 6]] * (MAX_QUEUE_LEN + 4)})
    assert many.status_code == 200 and len(many.json()["choices"]) == MAX_QUEUE_LEN + 4
    assert wait_until_idle(http, 0.0)["pagedserve_kv_cache_usage_perc"] == 0.0
