"""Admission rules and --request-timeout, in-process on an engine stand-in that never produces a token (so only
the timeout can end a request)."""
from __future__ import annotations

import threading
import time

import pytest

from engine.sampling_params import SamplingParams
from server.admission import MAX_CHOICES, AdmissionControl, Overloaded, check_budget
from tests.server.fakes import scripted_client
from tests.server.openapi import assert_valid
from tests.server.prom import GUARD_S
from tests.server.sse import parse_sse

TIMEOUT_S = 0.3


def test_queue_bound() -> None:
    control = AdmissionControl(max_queue_len=4)
    control.admit(num_waiting=0, num_new=100)       # an idle queue takes anything: serial clients never wait
    control.admit(num_waiting=3, num_new=1)
    with pytest.raises(Overloaded) as refused:
        control.admit(num_waiting=4, num_new=1)
    assert refused.value.retry_after >= 1 and "4" in str(refused.value)
    with pytest.raises(Overloaded):
        control.admit(num_waiting=1, num_new=4)
    with pytest.raises(ValueError):
        AdmissionControl(max_queue_len=0)


@pytest.mark.parametrize("n, max_tokens, prompts, ok", [
    (4, 100, 1, True),
    (4, 256, 1, True),              # exactly the capacity
    (4, 257, 1, False),
    (128, 8, 2, True),              # 256 choices
    (128, 8, 3, False),
    (64, None, 1, False),           # no max_tokens: the context left after the prompt counts
    (1, None, 1, True),             # one sample always fits (the engine checks that it fits alone)
])
def test_request_budget(n: int, max_tokens: int | None, prompts: int, ok: bool) -> None:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    call = lambda: check_budget(params, [10] * prompts, max_model_len=512, kv_capacity_tokens=1024)   # noqa: E731
    if ok:
        call()
    else:
        with pytest.raises(ValueError, match="lower n|choices"):
            call()
    assert MAX_CHOICES == 256


def test_request_timeout_aborts_plain_and_streamed_requests() -> None:
    for client, [loop] in scripted_client(request_timeout=TIMEOUT_S):
        results = {}

        def stream() -> None:
            results["stream"] = client.post("/v1/completions", json={"prompt": "hi", "n": 2, "stream": True})

        thread = threading.Thread(target=stream)
        start = time.monotonic()
        thread.start()
        plain = client.post("/v1/completions", json={"prompt": "hi"})
        thread.join(timeout=GUARD_S)
        elapsed = time.monotonic() - start
        assert not thread.is_alive()
        assert plain.status_code == 504 and plain.headers["content-type"] == "application/json"
        assert_valid(plain.json(), "ErrorResponse")
        assert plain.json()["error"]["type"] == "timeout_error"
        events = parse_sse(results["stream"].text)
        assert [c["finish_reason"] for e in events for c in e["choices"]] == ["abort", "abort"]
        assert elapsed >= TIMEOUT_S         # never before its time
        # The engine was told to stop both: one abort per engine request.
        assert sorted(reason for _, _, reason in loop.aborts) == ["abort", "abort"]
        assert len({request_id for request_id, _, _ in loop.aborts}) == 2
