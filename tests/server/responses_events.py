"""Reading and checking a /v1/responses event stream: every event validated against its schema in the official
OpenAI spec, sequence numbers strictly increasing, items opened and done in order, and the deltas joining into
what the terminal event's response holds."""
from __future__ import annotations

import json
from typing import Any

import httpx

from tests.server.openapi import assert_valid

# event type -> its schema in the spec
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
}
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def raw_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of each event of a stream; each SSE record is `event: <type>` then `data: <json>`."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    events = []
    for record in raw.split("\n\n")[:-1]:
        name_line, data_line = record.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), record
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):]
        events.append(data)
    return events


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Checks a whole stream; returns the terminal event's response."""
    for event in events:
        assert_valid(event, EVENT_SCHEMAS[event["type"]])
    numbers = [e["sequence_number"] for e in events]
    assert numbers == sorted(set(numbers)), numbers
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in TERMINAL and not any(k in TERMINAL for k in kinds[:-1]), kinds
    response = events[-1]["response"]
    assert response["id"] == events[0]["response"]["id"]
    assert_valid(response, "Response")
    items: list[dict[str, Any]] = []
    texts: dict[str, str] = {}
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(items)
            items.append(event["item"])
            texts[event["item"]["id"]] = ""
        elif kind.endswith(".delta"):
            assert event["output_index"] == len(items) - 1 and event["item_id"] == items[-1]["id"]
            texts[event["item_id"]] += event["delta"]
        elif kind == "response.output_item.done":
            assert event["output_index"] == len(items) - 1 and event["item"]["id"] == items[-1]["id"]
            items[-1] = event["item"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert event["text"] == texts[event["item_id"]]
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == texts[event["item_id"]]
    assert response["output"] == items
    for item in items:       # the deltas join into each item's whole text
        if item["type"] == "message":
            assert "".join(p["text"] for p in item["content"]) == texts[item["id"]]
        elif item["type"] == "function_call":
            assert item["arguments"] == texts[item["id"]]
    return response


def output_text(response: dict[str, Any]) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])
