"""Engine failures, injected through the test-only /_fault routes (PAGEDSERVE_ENABLE_FAULT_INJECTION=1):
a forward that raises fails its batch and nothing else; NaN/inf logits do not crash sampling; a request past
--request-timeout is aborted; an engine thread that dies fails everyone, turns /health 503 and makes the
process exit non-zero. No client ever hangs. The kill test is last: the module's server is gone after it.

Requests are in flight when a fault strikes by construction, not because they are long: the engine runs
slowly (/_fault/slow) until they have started, then is held (/_fault/hold) while the test checks that they
run and arms the fault."""
from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.helpers import (
    FAULTS,
    Outcome,
    fault,
    fault_async,
    first_events,
    gauges,
    long_body,
    metrics_async,
    min_seconds,
    post,
    wait_for_metrics,
)
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.openapi import assert_valid
from tests.server.prom import GUARD_S, is_idle, scrape, wait_until_idle

REQUEST_TIMEOUT_S = 1.0
SHORT = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-model-len", "512", env=FAULTS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def timeout_server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-model-len", "512", "--request-timeout", str(REQUEST_TIMEOUT_S),
                        env=FAULTS)
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
    """Starts a stream and some plain requests on a slow engine; once the stream has produced an event and all
    of them run, holds the engine, checks that they still run, arms `kind` and releases the engine (a kill
    strikes a held engine too: the server may be gone before a release). Returns every outcome (each client
    has a timeout: a hung one fails the test)."""
    count = 1 + len(plain_bodies)
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S) as client:
        await fault_async(client, "slow")       # 200 tokens take 10 s at least: they are running when held
        started = asyncio.Event()
        stream = asyncio.create_task(first_events(client, long_body(max_tokens=200, n=1), 1, started))
        plain = [asyncio.create_task(post(client, "/v1/completions", body)) for body in plain_bodies]
        await asyncio.wait_for(started.wait(), GUARD_S)
        await wait_for_metrics(client, lambda m: gauges(m) == (count, 0), f"{count} running")   # one batch
        await fault_async(client, "hold")
        assert gauges(await metrics_async(client)) == (count, 0)
        assert not stream.done() and not any(task.done() for task in plain)
        await fault_async(client, kind)
        if kind != "kill":
            await fault_async(client, "release")
        return await stream, list(await asyncio.gather(*plain))


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


def test_requests_past_the_timeout_are_aborted(timeout_server) -> None:
    """On a slow engine the requests need 480 steps (24 s at least), far past the timeout: the timeout ends
    them. Then the engine is held: it runs no step, so only the aborts can leave it idle, its KV cache back."""
    body = long_body(max_tokens=480, n=16)
    assert min_seconds(body["max_tokens"]) > 10 * REQUEST_TIMEOUT_S

    async def run() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=timeout_server.base_url, timeout=GUARD_S) as client:
            await fault_async(client, "slow")
            return list(await asyncio.gather(post(client, "/v1/completions", body),
                                             post(client, "/v1/completions", body, stream=True)))

    with httpx.Client(base_url=timeout_server.base_url, timeout=GUARD_S) as http:
        before = scrape(http)
        plain, stream = asyncio.run(run())
        fault(http, "hold")
        after = wait_until_idle(http, before["pagedserve_kv_cache_usage_perc"])
        fault(http, "release")
        assert is_idle(after, before["pagedserve_kv_cache_usage_perc"]), after
        response = http.post("/v1/completions", json=SHORT)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]
    assert plain.status == 504 and plain.json()["error"]["code"] == "request_timeout"
    assert_valid(plain.json(), "ErrorResponse")
    last = {}
    for event in stream.events():
        for choice in event["choices"]:
            last[choice["index"]] = choice["finish_reason"]
    assert last == {i: "abort" for i in range(16)}
    for outcome in (plain, stream):
        assert outcome.elapsed >= REQUEST_TIMEOUT_S       # never before its time (measured from before it was sent)
    grew = {reason: after[f"pagedserve_request_success_total{{{reason}}}"]
            - before[f"pagedserve_request_success_total{{{reason}}}"] for reason in ("abort", "length", "error")}
    assert grew == {"abort": 2, "length": 0, "error": 0}


def test_engine_death_fails_everyone_and_exits_non_zero(server, http: httpx.Client) -> None:
    stream, plain = asyncio.run(_fault_during(server.base_url, "kill", [long_body(max_tokens=200, n=2)]))
    check_failed(stream)
    check_failed(plain[0], 500)
    # Until the process exits (about a second later), /health and new requests answer 503; after it, the port
    # is closed. Which of the two a client sees depends on its speed: both are right. (tests/server/test_bridge.py
    # checks the 503s in-process, where the process does not exit.)
    for path, method in (("/health", "GET"), ("/v1/completions", "POST")):
        try:
            response = http.request(method, path, json=SHORT if method == "POST" else None, timeout=GUARD_S)
        except httpx.TransportError:
            continue
        assert response.status_code == 503, (path, response.text)
        assert_valid(response.json(), "ErrorResponse")
    assert server.proc.wait(timeout=GUARD_S) == 1
    log = server.log_tail(200_000)
    assert "the engine died" in log and "exiting with status 1" in log
