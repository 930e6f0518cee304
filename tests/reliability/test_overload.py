"""Admission control: 4 x max_queue_len requests at once. The excess is refused with 429 at once (a real
status, before any SSE byte, with Retry-After and the error envelope), the rest complete correctly, /health
answers quickly throughout, and the queue never grows past its bound."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import Outcome, long_body, post
from tests.server.conftest import start_server
from tests.server.openapi import assert_valid
from tests.server.prom import wait_until_idle

MAX_QUEUE_LEN, MAX_NUM_SEQS = 8, 4
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-len", str(MAX_QUEUE_LEN))
    yield proc
    proc.stop()


async def _storm(base_url: str) -> tuple[list[Outcome], list[float], list[dict[str, float]]]:
    total = 4 * MAX_QUEUE_LEN
    body = long_body(max_tokens=MAX_TOKENS, n=1)
    limits = httpx.Limits(max_connections=total + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits) as client:
        done = asyncio.Event()
        health_latency: list[float] = []
        gauges: list[dict[str, float]] = []

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as prober:   # its own connection
                while not done.is_set():
                    start = time.monotonic()
                    assert (await prober.get("/health")).status_code == 200
                    health_latency.append(time.monotonic() - start)
                    text = (await prober.get("/metrics")).text
                    gauges.append({name: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                   for name in ("running", "waiting")
                                   if line.startswith(f"pagedserve_num_requests_{name}{{")})
                    await asyncio.sleep(0.05)

        prober = asyncio.create_task(probe())
        outcomes = await asyncio.gather(*(post(client, "/v1/completions", body, stream=i % 2 == 1)
                                          for i in range(total)))
        done.set()
        await prober
    return outcomes, health_latency, gauges


def test_excess_is_refused_at_once_and_the_rest_complete(server, http: httpx.Client) -> None:
    outcomes, health_latency, gauges = asyncio.run(_storm(server.base_url))
    refused = [o for o in outcomes if o.status == 429]
    served = [o for o in outcomes if o.status == 200]
    assert len(refused) + len(served) == len(outcomes), sorted({o.status for o in outcomes})
    # An idle queue takes MAX_QUEUE_LEN; as the engine starts up to MAX_NUM_SEQS of them, that many more.
    assert MAX_QUEUE_LEN <= len(served) <= MAX_QUEUE_LEN + 2 * MAX_NUM_SEQS
    for o in refused:
        assert not o.text.startswith("data:"), "a refused stream must not start"
        assert o.headers["content-type"].startswith("application/json")
        assert int(o.headers["retry-after"]) >= 1
        assert_valid(o.json(), "ErrorResponse")
        assert o.json()["error"]["type"] == "rate_limit_error"
    assert max(o.elapsed for o in refused) < 1.0
    assert max(o.elapsed for o in refused) < min(o.elapsed for o in served)
    for o in served:
        if o.streamed:
            events = o.events()
            assert not any("error" in e for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert o.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert health_latency and max(health_latency) < 1.0
    assert max(g["waiting"] for g in gauges) <= MAX_QUEUE_LEN
    assert max(g["running"] for g in gauges) <= MAX_NUM_SEQS


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
