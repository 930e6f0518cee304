"""Admission rules and --request-timeout, in-process on an engine stand-in that never produces a token (so only
the timeout can end a request)."""
from __future__ import annotations

import threading
import time

import pytest

from engine.model_info import ModelInfo, TokenizerSource
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


@pytest.mark.parametrize("n, prompts, ok", [(128, 2, True), (128, 3, False), (1, 256, True), (2, 129, False)])
def test_request_choices(n: int, prompts: int, ok: bool) -> None:
    call = lambda: check_budget(SamplingParams(n=n, max_tokens=4), prompts)   # noqa: E731
    if ok:
        call()
    else:
        with pytest.raises(ValueError, match=f"{prompts} x {n} = {prompts * n}"):
            call()
    assert MAX_CHOICES == 256


@pytest.mark.parametrize("n, max_tokens, ok", [
    (4, 100, True),
    (4, 254, True),                 # 10 + 4 x 254 = 1026 tokens: exactly 257 blocks of 4, the whole cache
    (4, 255, False),
    (64, None, False),              # no max_tokens: the context left after the prompt counts, per sample
    (1, None, True),
])
def test_request_kv_need_is_checked_at_the_door(n: int, max_tokens: int | None, ok: bool) -> None:
    """A request whose prompt + n x max_tokens exceeds the whole KV cache could never run: 400, with the
    numbers, before it takes a place in the queue."""
    info = ModelInfo("m", max_model_len=512, vocab_size=100, eos_token_ids=(), num_kv_blocks=258, block_size=4,
                     max_num_seqs=4, tokenizer=TokenizerSource("."))
    call = lambda: info.check_request(list(range(10)), SamplingParams(n=n, max_tokens=max_tokens))   # noqa: E731
    if ok:
        call()
        return
    with pytest.raises(ValueError) as refused:
        call()
    tokens = 10 + n * (max_tokens or 502)
    assert (f"needs {-(-tokens // 4)} KV blocks of 4 tokens (prompt 10 + n x max_tokens = {n} x "
            f"{max_tokens or 502} = {tokens} tokens) but the KV cache holds only 257 blocks") in str(refused.value)


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
