"""Reads a server-sent-events body and checks its framing on the way."""
from __future__ import annotations

import json
from typing import Any

import httpx


def parse_sse(raw: str) -> list[Any]:
    """`data: <json>` events separated by blank lines, ending with `data: [DONE]`; returns the JSON events."""
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-80:]!r}"
    events = raw[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"not a data line: {event[:80]!r}"
        assert "\n" not in event, f"an event spans several lines: {event[:80]!r}"
        payloads.append(event[len("data: "):])
    assert payloads[-1] == "[DONE]", "the stream does not end with data: [DONE]"
    assert "[DONE]" not in payloads[:-1], "data: [DONE] before the end"
    return [json.loads(p) for p in payloads[:-1]]


def stream_events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse(response.read().decode("utf-8"))


def texts_by_index(events: list[dict], key: str = "text") -> dict[int, str]:
    """Joins each choice's streamed text (completions: choice['text']; chat: delta['content'])."""
    joined: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            piece = choice[key] if key == "text" else choice["delta"].get("content") or ""
            joined[choice["index"]] = joined.get(choice["index"], "") + piece
    return joined
