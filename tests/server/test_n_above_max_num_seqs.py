"""n above --max-num-seqs, served: the request completes, and a small request sent after it is not held back.

`--max-num-seqs 4` and `n: 5`: the five samples are scheduled as sequences of their own, four at a time, so
the request no longer waits forever at the head of the queue (it used to block every request behind it).
The small request finishes first: it runs as soon as the first four samples leave the batch, while the
fifth still has all its tokens to make. The order is what is checked, never a time.
"""
from __future__ import annotations

import json
import threading

import httpx

from tests.server.conftest import MODEL_NAME, start_server


def test_n_above_max_num_seqs_completes_and_does_not_hold_back_a_later_request(tiny_checkpoint) -> None:
    server = start_server(tiny_checkpoint, "--max-num-seqs", "4")
    finished: list[str] = []
    started = threading.Event()
    big_events: list[dict] = []
    try:
        big_body = {"model": MODEL_NAME, "prompt": "Once upon a time", "n": 5, "max_tokens": 150,
                    "ignore_eos": True, "temperature": 0, "stream": True}

        def big() -> None:
            with httpx.Client(base_url=server.base_url, timeout=300.0) as http:
                with http.stream("POST", "/v1/completions", json=big_body) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            big_events.append(json.loads(line[len("data: "):]))
                            started.set()
            finished.append("big")

        thread = threading.Thread(target=big)
        thread.start()
        assert started.wait(timeout=120)        # its prompt is prefilled and its samples are generating
        with httpx.Client(base_url=server.base_url, timeout=300.0) as http:
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
                                                    "ignore_eos": True})
            finished.append("small")
        thread.join(timeout=300)
        assert not thread.is_alive()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert finished == ["small", "big"]
        reasons = {c["index"]: c["finish_reason"] for e in big_events for c in e["choices"] if c["finish_reason"]}
        assert reasons == {i: "length" for i in range(5)}
        tokens = {}
        for e in big_events:
            for c in e["choices"]:
                tokens[c["index"]] = tokens.get(c["index"], "") + c["text"]
        assert len(set(tokens.values())) == 1      # greedy: the five samples agree
    finally:
        server.stop()
