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

from tests.reliability.helpers import FAULTS, refused_while_full
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.prom import scrape

BODY = {"model": MODEL_NAME, "max_output_tokens": 50, "input": "Hi"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-num-seqs", "1", "--max-queue-len", "1", env=FAULTS)
    yield proc
    proc.stop()


def test_full_queue_and_disconnect(server, http: httpx.Client) -> None:
    before = scrape(http)
    refused, waiting_status = asyncio.run(refused_while_full(server.base_url, "/v1/responses", BODY))
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
