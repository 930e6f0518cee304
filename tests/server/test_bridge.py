"""The asyncio <-> engine-thread bridge with the test playing the engine: exact token scripts for stop
strings across tokens and n > 1, and an engine thread that dies mid-request. In-process (no model)."""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta
from tests.server.fakes import ScriptedClient, asgi_post, loop_turns, scripted_app, scripted_client
from tests.server.sse import parse_sse


@pytest.fixture
def setup() -> Iterator[tuple[TestClient, list[ScriptedClient]]]:
    yield from scripted_client()


def _play(loop: ScriptedClient, steps: list[dict[int, tuple[str, str | None]]]) -> threading.Thread:
    """In a thread (like the engine's): waits for the request, then delivers one delta per step.
    A step maps sample index -> (token text, finish reason)."""
    tok = loop.tokenizer

    def run() -> None:
        request_id, prompt, _, arrival = loop.added.get(timeout=10)
        timings = RequestTimings(arrival_time=arrival or 0.0, first_scheduled_time=arrival, first_token_time=arrival)
        for i, step in enumerate(steps):
            seqs = [SequenceDelta(index, tok.encode(text, add_special_tokens=False), None, reason) for index, (text, reason) in step.items()]
            last = i == len(steps) - 1
            loop.deliver([RequestDelta(request_id, seqs, last, len(prompt), 0, timings)], EngineStats(num_running=1))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# Sample 0 completes the stop string "ab" across two tokens, then gets one more (ignored) token;
# sample 1 never matches and ends by length.
SCRIPT = [{0: ("x", None), 1: ("q", None)},
          {0: ("a", None), 1: ("r", None)},
          {0: ("b", None), 1: ("s", None)},
          {0: ("z", None), 1: ("t", "length")}]
BODY = {"prompt": "hi", "n": 2, "stop": "ab", "max_tokens": 4}


def test_stop_string_across_tokens_stops_only_its_sample(setup) -> None:
    client, [loop] = setup
    player = _play(loop, SCRIPT)
    data = client.post("/v1/completions", json=BODY).json()
    player.join()
    first, second = data["choices"]
    assert (first["text"], first["finish_reason"], first["stop_reason"]) == ("x", "stop", "ab")
    assert (second["text"], second["finish_reason"]) == ("qrst", "length")
    assert data["usage"]["completion_tokens"] == 3 + 4      # up to the token completing "ab"; "z" ignored
    request_id = loop.aborts[0][0]
    assert loop.aborts == [(request_id, 0, "stop")]         # the engine is told to stop sample 0 only


def test_streamed_stop_string_is_never_leaked(setup) -> None:
    client, [loop] = setup
    player = _play(loop, SCRIPT)
    response = client.post("/v1/completions", json={**BODY, "stream": True})
    player.join()
    events = parse_sse(response.text)
    by_index: dict[int, str] = {0: "", 1: ""}
    for event in events:
        [choice] = event["choices"]
        by_index[choice["index"]] += choice["text"]
        assert "a" not in by_index[0], "a possible start of the stop string was sent before it was decided"
    assert by_index == {0: "x", 1: "qrst"}


def test_engine_death_fails_requests_and_health(setup) -> None:
    client, [loop] = setup
    assert client.get("/health").status_code == 200
    results: dict[str, object] = {}
    waiters = [threading.Thread(target=lambda: results.update(plain=client.post("/v1/completions", json={
                   "prompt": "hi"})), daemon=True),
               threading.Thread(target=lambda: results.update(stream=client.post("/v1/completions", json={
                   "prompt": "hi", "stream": True})), daemon=True)]
    for waiter in waiters:
        waiter.start()
    loop.added.get(timeout=10)
    loop.added.get(timeout=10)
    loop.die()
    for waiter in waiters:
        waiter.join(timeout=20)
    plain = results["plain"]
    assert plain.status_code == 500 and "Generation failed" in plain.json()["error"]["message"]
    stream = results["stream"]
    assert stream.status_code == 200 and "Generation failed" in parse_sse(stream.text)[-1]["error"]["message"]
    assert client.get("/health").status_code == 503
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503 and json.loads(response.text)["error"]["message"]


async def _role_chunk_case() -> tuple[list[bytes], list[bytes]]:
    """A streamed chat request through the ASGI app, the test playing the engine: returns the body chunks sent
    before the engine delivered a token (however long the prefill took), and all of them."""
    app, [loop] = scripted_app()
    await app.state.ctx.async_engine.start()
    chunks: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2}).encode()
    task = asyncio.ensure_future(asgi_post(app, "/v1/chat/completions", body, send))
    await loop_turns()
    request_id, prompt, _, arrival = loop.added.get_nowait()     # the request is in the "engine", prefilling
    await loop_turns()
    before_first_token = list(chunks)
    token = loop.tokenizer.encode("Hello", add_special_tokens=False)
    for last in (False, True):
        seqs = [SequenceDelta(0, token, None, "length" if last else None)]
        loop.deliver([RequestDelta(request_id, seqs, last, len(prompt), 0, RequestTimings(arrival))],
                     EngineStats(num_running=1))
        await loop_turns()
    await asyncio.wait_for(task, 60)
    return before_first_token, chunks


def test_chat_role_chunk_comes_with_the_first_token_not_before_prefill() -> None:
    """Clients time the first token from the first chunk: the role chunk must not go out during prefill."""
    before_first_token, chunks = asyncio.run(_role_chunk_case())
    assert before_first_token == [], "the role chunk was sent before the first token existed"
    events = parse_sse(b"".join(chunks).decode())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"]["content"]
