"""/v1/responses goes through the same door as chat: with the queue full, a 429 in the OpenAI envelope (a real
status, before any event, with Retry-After), and a client that leaves aborts its request in the engine.

By construction, not by speed: one request runs on a slow engine (/_fault/slow), then the engine is held
(/_fault/hold): nothing finishes or starts, so a request that waits stays waiting until its client leaves,
and only that abort can take it out of the engine."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.reliability.helpers import FAULTS, fault_async, gauges, long_body, post, wait_for_metrics
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.prom import GUARD_S, scrape

BODY = {"model": MODEL_NAME, "max_output_tokens": 50, "input": "Hi"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-num-seqs", "1", "--max-queue-len", "1", env=FAULTS)
    yield proc
    proc.stop()


async def _full_queue(base_url: str) -> tuple[httpx.Response, int]:
    """A response refused while one request runs and one waits; returns it, and the waiting one's status."""
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S) as client:
        await fault_async(client, "slow")
        running = asyncio.create_task(post(client, "/v1/completions", long_body(max_tokens=200, n=1)))
        await wait_for_metrics(client, lambda m: gauges(m) == (1, 0), "one running")
        await fault_async(client, "hold")
        async with client.stream("POST", "/v1/responses", json={**BODY, "stream": True}) as waiting:
            await wait_for_metrics(client, lambda m: gauges(m) == (1, 1), "one running, one waiting")
            refused = await client.post("/v1/responses", json=BODY)
        # The stream's client left: its request is aborted, though the engine runs no step.
        await wait_for_metrics(client, lambda m: gauges(m) == (1, 0), "the waiting response aborted")
        await fault_async(client, "release")
        assert (await running).status == 200
        return refused, waiting.status_code


def test_full_queue_and_disconnect(server, http: httpx.Client) -> None:
    before = scrape(http)
    refused, waiting_status = asyncio.run(_full_queue(server.base_url))
    assert waiting_status == 200
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.headers["content-type"].startswith("application/json")
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.json()["error"]["code"] == "server_overloaded"
    after = scrape(http)
    assert after["pagedserve_request_success_total{abort}"] - before["pagedserve_request_success_total{abort}"] == 1
    assert http.get("/health").status_code == 200
    # And the next response is served (and the aborted one was not stored).
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    assert client.responses.create(**BODY).usage.output_tokens > 0
