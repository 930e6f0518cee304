"""Engine failures, injected through the test-only /_fault routes (PAGEDSERVE_ENABLE_FAULT_INJECTION=1):
a forward that raises fails its batch and nothing else; NaN/inf logits do not crash sampling; a request past
--request-timeout is aborted; an engine thread that dies fails everyone, turns /health 503 and makes the
process exit non-zero. No client ever hangs. The kill test is last: the module's server is gone after it."""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import Outcome, first_events, long_body, post
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.openapi import assert_valid
from tests.server.prom import scrape, wait_until_idle

REQUEST_TIMEOUT_S = 1.0
SHORT = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-model-len", "512", "--request-timeout", str(REQUEST_TIMEOUT_S),
                        env={"PAGEDSERVE_ENABLE_FAULT_INJECTION": "1"})
    yield proc
    proc.stop()


def check_failed(outcome: Outcome, status: int = 500) -> None:
    """A plain request: the status and the envelope. A stream: 200, an error event, then [DONE]."""
    if outcome.streamed:
        assert outcome.status == 200
        events = outcome.events()             # parse_sse checks the stream ends with data: [DONE]
        assert_valid(events[-1], "ErrorResponse")
        assert not any("error" in e for e in events[:-1])
    else:
        assert outcome.status == status, outcome.text
        assert_valid(outcome.json(), "ErrorResponse")
    assert "Traceback" not in outcome.text


async def _fault_during(base_url: str, kind: str, plain_bodies: list[dict]) -> tuple[Outcome, list[Outcome]]:
    """Starts a stream and some plain requests, arms `kind` once the stream has produced an event, and
    returns every outcome (each client has a timeout: a hung one fails the test)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        started = asyncio.Event()
        stream = asyncio.create_task(first_events(client, long_body(max_tokens=200, n=1), 1, started))
        plain = [asyncio.create_task(post(client, "/v1/completions", body)) for body in plain_bodies]
        await asyncio.wait_for(started.wait(), 20)
        await asyncio.wait_for(_until_running(client, 1 + len(plain_bodies)), 20)   # all in the next batch
        assert (await client.post(f"/_fault/{kind}")).json() == {"armed": kind}
        return await stream, list(await asyncio.gather(*plain))


async def _until_running(client: httpx.AsyncClient, count: int) -> None:
    while True:
        text = (await client.get("/metrics")).text
        running = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("pagedserve_num_requests_running{"))
        if running >= count:
            return
        await asyncio.sleep(0.01)


def test_forward_failure_fails_its_batch_and_the_engine_goes_on(server, http: httpx.Client) -> None:
    before = scrape(http)
    stream, plain = asyncio.run(_fault_during(server.base_url, "forward", [long_body(max_tokens=200, n=2)] * 2))
    for outcome in [stream, *plain]:
        check_failed(outcome, 500)
    assert plain[0].json()["error"]["type"] == "server_error"
    assert http.get("/health").status_code == 200
    after = wait_until_idle(http, before["pagedserve_kv_cache_usage_perc"])
    assert after["pagedserve_request_success_total{error}"] - before["pagedserve_request_success_total{error}"] == 3
    response = http.post("/v1/completions", json=SHORT)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.5, "logit_bias": {"5": 3}},
])
def test_nan_and_inf_logits_do_not_crash_sampling(server, http: httpx.Client, sampling: dict) -> None:
    assert http.post("/_fault/nan").status_code == 200
    body = {**SHORT, "max_tokens": 4, "logprobs": 3, "n": 2, **sampling}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = json.loads(response.text)      # strict JSON: NaN or Infinity would not parse back as numbers
    for choice in data["choices"]:
        assert choice["finish_reason"] == "length"
        values = choice["logprobs"]["token_logprobs"]
        values += [v for top in choice["logprobs"]["top_logprobs"] for v in top.values()]
        assert all(math.isfinite(v) and v >= -9999.0 for v in values)
    assert data["usage"]["completion_tokens"] == 2 * 4
    assert http.post("/v1/completions", json=SHORT).status_code == 200


def test_requests_past_the_timeout_are_aborted(server, http: httpx.Client) -> None:
    async def run() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
            return list(await asyncio.gather(post(client, "/v1/completions", long_body()),
                                             post(client, "/v1/completions", long_body(), stream=True)))

    kv_baseline = scrape(http)["pagedserve_kv_cache_usage_perc"]
    plain, stream = asyncio.run(run())
    assert plain.status == 504 and plain.json()["error"]["code"] == "request_timeout"
    assert_valid(plain.json(), "ErrorResponse")
    last = {}
    for event in stream.events():
        for choice in event["choices"]:
            last[choice["index"]] = choice["finish_reason"]
    assert last == {i: "abort" for i in range(16)}
    for outcome in (plain, stream):
        assert REQUEST_TIMEOUT_S <= outcome.elapsed < REQUEST_TIMEOUT_S + 5
    after = wait_until_idle(http, kv_baseline)
    assert after["pagedserve_num_requests_running"] == 0 and after["pagedserve_kv_cache_usage_perc"] == kv_baseline


def test_engine_death_fails_everyone_and_exits_non_zero(server, http: httpx.Client) -> None:
    stream, plain = asyncio.run(_fault_during(server.base_url, "kill", [long_body(max_tokens=200, n=2)]))
    check_failed(stream)
    check_failed(plain[0], 500)
    # Until the process exits, /health and new requests answer 503 (or the port is already closed).
    statuses = []
    for path, method in (("/health", "GET"), ("/v1/completions", "POST")):
        try:
            response = http.request(method, path, json=SHORT if method == "POST" else None, timeout=5.0)
            statuses.append(response.status_code)
            assert_valid(response.json(), "ErrorResponse")
        except httpx.TransportError:
            statuses.append(None)
    assert statuses[0] == 503 and statuses[1] in (503, None)
    start = time.monotonic()
    assert server.proc.wait(timeout=30) == 1
    assert time.monotonic() - start < 15
    log = server.log_tail(200_000)
    assert "the engine died" in log and "exiting with status 1" in log
