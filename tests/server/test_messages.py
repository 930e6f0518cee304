"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) on the tiny random model, with the
unmodified anthropic SDK against a real server: the same text and token counts as /v1/chat/completions, streams
that join into the whole answer in Anthropic's event order, forced tool calls, and stop reasons."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, pick_stop, start_server
from tests.server.server_proc import ServerProcess

SYSTEM = "You are terse."
# The anthropic SDK (2.x) has no sampling arguments; the API still takes them in the body.
GREEDY = {"temperature": 0}
MESSAGES = [{"role": "user", "content": "Tell me about the sea."},
            {"role": "assistant", "content": "It is big."},
            {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "the sky?"}]}]
# The same conversation as chat messages (text blocks join with a newline, as chat's content parts do).
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, MESSAGES[0], MESSAGES[1],
                 {"role": "user", "content": "And\nthe sky?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {
    "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:
    # tool_choice auto (Anthropic's default with tools) needs a parser: the tiny template writes hermes calls.
    # A longer context than the default: the template lists the tools in the prompt.
    proc = start_server(tiny_checkpoint, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-model-len", "512")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def raw_events(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a stream; each event's data names its own type."""
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = []
    for chunk in raw.split("\n\n")[:-1]:
        name_line, data_line = chunk.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), chunk
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name
        events.append((name, data))
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    return events


def check_event_order(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Anthropic's order: message_start, then each block started, its deltas, stopped (indexes 0, 1, ...),
    then message_delta and message_stop. Returns the blocks with their deltas joined."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    blocks: list[dict[str, Any]] = []
    open_index = None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({**data["content_block"], "partial_json": ""})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta, block = data["delta"], blocks[open_index]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                block["partial_json"] += delta["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index, (name, data)
            open_index = None
    assert open_index is None
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    return blocks


def test_text_and_usage_equal_chat_completions(client: anthropic.Anthropic, http: httpx.Client) -> None:
    message = client.messages.create(model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=MESSAGES,
                                     extra_body=GREEDY)
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT_MESSAGES,
                                                   "max_tokens": 12, "temperature": 0.0}).json()
    [choice] = chat["choices"]
    assert text_of(message) == choice["message"]["content"] and message.content[0].type == "text"
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert message.id.startswith("msg_") and message.model == MODEL_NAME and message.role == "assistant"
    assert choice["finish_reason"] == "length" and message.stop_reason == "max_tokens"
    assert message.stop_sequence is None
    # The system prompt as text blocks is the same prompt.
    blocks = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=MESSAGES, extra_body=GREEDY,
                                    system=[{"type": "text", "text": SYSTEM}])
    assert text_of(blocks) == text_of(message)
    counted = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == message.usage.input_tokens


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    full = text_of(client.messages.create(model=MODEL_NAME, max_tokens=30, messages=MESSAGES, extra_body=GREEDY))
    stop = pick_stop(full)
    message = client.messages.create(model=MODEL_NAME, max_tokens=30, messages=MESSAGES, extra_body=GREEDY,
                                     stop_sequences=["@@never@@", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == full[:full.index(stop)]
    with client.messages.stream(model=MODEL_NAME, max_tokens=30, messages=MESSAGES, extra_body=GREEDY,
                                stop_sequences=[stop]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(message) and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_stream_joins_into_the_whole_message(client: anthropic.Anthropic, http: httpx.Client) -> None:
    whole = client.messages.create(model=MODEL_NAME, max_tokens=16, system=SYSTEM, messages=MESSAGES,
                                   extra_body=GREEDY)
    with client.messages.stream(model=MODEL_NAME, max_tokens=16, system=SYSTEM, messages=MESSAGES,
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text_of(whole)
    assert [(b.type, b.text) for b in final.content] == [("text", text_of(whole))]
    assert final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens == 16
    events = raw_events(http, {"model": MODEL_NAME, "max_tokens": 16, "system": SYSTEM, "messages": MESSAGES,
                               "temperature": 0})
    [block] = check_event_order(events)
    assert block["type"] == "text" and block["text"] == text_of(whole)
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 16


def test_forced_tool_and_the_round_trip(client: anthropic.Anthropic, http: httpx.Client) -> None:
    tools = [WEATHER, TIME]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    message = client.messages.create(model=MODEL_NAME, max_tokens=80, messages=ask, tools=tools, extra_body=GREEDY,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # Streamed: the input_json_delta pieces join into the same input.
    body = {"model": MODEL_NAME, "max_tokens": 80, "messages": ask, "tools": tools, "temperature": 0,
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    [block] = check_event_order(events := raw_events(http, body))
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert json.loads(block["partial_json"]) == call.input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY) as stream:
        assert stream.get_final_message().content[0].input == call.input
    # "any": some tool, one call when parallel calls are off.
    anyone = client.messages.create(model=MODEL_NAME, max_tokens=80, messages=ask, tools=tools, extra_body=GREEDY,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert anyone.stop_reason == "tool_use"
    [picked] = anyone.content
    jsonschema.validate(picked.input, {t["name"]: t["input_schema"] for t in tools}[picked.name])
    # The follow-up: the assistant's tool_use and the user's tool_result are accepted and answered.
    follow = [*ask, {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in message.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                                           {"type": "text", "text": "Thanks!"}]}]
    answer = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=follow, tools=tools, extra_body=GREEDY)
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use") and answer.usage.output_tokens > 0
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=follow, tools=tools)
    assert counted.input_tokens == answer.usage.input_tokens
    # The call and its result reach the prompt: as chat renders them.
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "max_tokens": 8, "temperature": 0.0, "tools": [_as_openai(t) for t in tools],
        "messages": [*ask, {"role": "assistant", "content": "", "tool_calls": [{
            "id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
            {"role": "user", "content": "Thanks!"}]}).json()
    assert chat["usage"]["prompt_tokens"] == answer.usage.input_tokens


def _as_openai(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def test_the_document_describes_the_routes(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    create = paths["/v1/messages"]["post"]["responses"]
    assert create["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/AnthropicMessage"}
    assert create["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AnthropicErrorResponse"}
    count = paths["/v1/messages/count_tokens"]["post"]["responses"]
    assert count["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CountTokensResponse"}
