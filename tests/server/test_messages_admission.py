"""/v1/messages goes through the same door as chat: with the queue full, a 429 in Anthropic's shape (a real
status, before any event, with Retry-After), and a client that leaves aborts its request in the engine.

By construction, not by speed: one request runs on a slow engine (/_fault/slow), then the engine is held
(/_fault/hold): nothing finishes or starts, so a request that waits stays waiting until its client leaves,
and only that abort can take it out of the engine."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tests.reliability.helpers import FAULTS, refused_while_full
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.prom import scrape

MESSAGE = {"model": MODEL_NAME, "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-num-seqs", "1", "--max-queue-len", "1", env=FAULTS)
    yield proc
    proc.stop()


def test_full_queue_and_disconnect(server, http: httpx.Client) -> None:
    before = scrape(http)
    refused, waiting_status = asyncio.run(refused_while_full(server.base_url, "/v1/messages", MESSAGE))
    assert waiting_status == 200
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.headers["content-type"].startswith("application/json")
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
    after = scrape(http)
    assert after["pagedserve_request_success_total{abort}"] - before["pagedserve_request_success_total{abort}"] == 1
    assert http.get("/health").status_code == 200
    # And the next message is served.
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    assert client.messages.create(**MESSAGE).usage.output_tokens > 0
