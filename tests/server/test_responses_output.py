"""The Responses mapping alone: input items -> chat messages, a whole chat message -> output items, and chat
deltas (reasoning, text, tool calls) -> typed events in the spec's order, each valid against its schema; and
reasoning items end to end under --reasoning-parser, in-process with the test playing the engine."""
from __future__ import annotations

import asyncio
import json

from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta
from server.chat_plan import ChatOptions
from server.responses_output import ItemEvents, output_items
from server.responses_protocol import ResponsesRequest
from tests.server.fakes import asgi_post, loop_turns, scripted_app
from tests.server.openapi import assert_valid
from tests.server.responses_events import EVENT_SCHEMAS, check_stream, output_text


def _events(raw: bytes) -> list[dict]:
    out = []
    for record in raw.decode().split("\n\n")[:-1]:
        name, data = record.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        assert_valid(event, EVENT_SCHEMAS[event["type"]])
        out.append(event)
    return out


def test_items_of_a_whole_message() -> None:
    message = {"role": "assistant", "content": "Hi", "reasoning_content": "hmm",
               "tool_calls": [{"id": "call_ab", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    reasoning, text, call = output_items(message, "completed")
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert reasoning["id"].startswith("rs_") and text["id"].startswith("msg_")
    assert text["content"] == [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}]
    assert call == {"type": "function_call", "id": "fc_ab", "call_id": "call_ab", "name": "f",
                    "arguments": '{"a": 1}', "status": "completed"}
    assert output_items({"role": "assistant", "content": ""}, "incomplete") == []


def test_events_from_deltas_in_order() -> None:
    items = ItemEvents()
    raw = b"".join([
        items.delta({"reasoning_content": "hm"}), items.delta({"reasoning_content": "m", "content": "H"}),
        items.delta({"content": "i"}),
        items.delta({"tool_calls": [{"index": 0, "id": "call_ab", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
        items.delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        items.delta({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}},
                                    {"index": 1, "id": "call_cd", "type": "function",
                                     "function": {"name": "g", "arguments": "{}"}}]}),
        items.delta({}), items.finish("completed")])
    events = _events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"].removeprefix("response."), e.get("output_index")) for e in events] == [
        ("output_item.added", 0), ("reasoning_text.delta", 0), ("reasoning_text.delta", 0),
        ("reasoning_text.done", 0), ("output_item.done", 0),
        ("output_item.added", 1), ("content_part.added", 1), ("output_text.delta", 1), ("output_text.delta", 1),
        ("output_text.done", 1), ("content_part.done", 1), ("output_item.done", 1),
        ("output_item.added", 2), ("function_call_arguments.delta", 2), ("function_call_arguments.delta", 2),
        ("function_call_arguments.done", 2), ("output_item.done", 2),
        ("output_item.added", 3), ("function_call_arguments.delta", 3), ("function_call_arguments.done", 3),
        ("output_item.done", 3)]
    reasoning, message, first, second = items.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "Hi" and message["status"] == "completed"
    assert (first["name"], first["arguments"], second["name"], second["arguments"]) == ("f", '{"a": 1}', "g", "{}")
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == items.items


def test_a_cut_item_is_incomplete() -> None:
    items = ItemEvents()
    items.delta({"content": "Hel"})
    done = _events(items.finish("incomplete"))
    assert done[-1]["item"]["status"] == "incomplete" and done[-1]["item"]["content"][0]["text"] == "Hel"
    assert ItemEvents().finish("completed") == b""


def test_items_become_chat_messages() -> None:
    """Calls join the assistant turn before them, outputs are tool messages, reasoning stays out."""
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "S", "max_output_tokens": 5, "temperature": 1, "top_p": 0.5,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False, "user": "u",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Q1"}, {"type": "input_text", "text": "Q2"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                  {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Let me see.", "annotations": [], "logprobs": []}]},
                  {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": '{"a": 1}',
                   "status": "completed"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "one"},
                  {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
                  {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c3", "output": "three"},
                  {"role": "developer", "content": "D"}]})
    chat = body.to_chat()
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q1\nQ2"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"}, {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "three", "tool_call_id": "c3"}, {"role": "developer", "content": "D"}]
    assert chat.tool_choice.function.name == "f" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.strict is True and chat.tools[0].function.parameters == {"type": "object"}
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.user) == (5, 1.0, 0.5, "u")
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.name == "x"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    # with no tools, the tool_choice the SDKs send by default asks for nothing
    assert ResponsesRequest.model_validate({"input": "hi", "tool_choice": "auto"}).to_chat().tool_choice is None


THOUGHT = ["<think>", "hm", "m", "</think>", "Hi", " there"]


async def _reasoning_answer(stream: bool, fail: bool = False) -> bytes:
    """One /v1/responses request in-process under --reasoning-parser qwen3, the test playing the engine: the
    output opens with a think block (or, with `fail`, the engine fails the request after its first token)."""
    app, [client] = scripted_app(chat_options=ChatOptions(reasoning_parser="qwen3"))
    await app.state.ctx.async_engine.start()
    chunks: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message["body"])

    body = json.dumps({"input": "hi", "max_output_tokens": 20, "stream": stream}).encode()
    task = asyncio.ensure_future(asgi_post(app, "/v1/responses", body, send))
    await loop_turns()
    request_id, prompt, _, arrival = client.added.get_nowait()
    for step, word in enumerate(THOUGHT):
        last = step == len(THOUGHT) - 1
        ids = client.tokenizer.encode(word, add_special_tokens=False)
        error = "boom" if fail and step == 1 else None
        client.deliver([RequestDelta(request_id, [SequenceDelta(0, ids, None, "stop" if last else None)], last,
                                     len(prompt), 0, RequestTimings(arrival or 0.0), error=error)], EngineStats())
        await loop_turns()
        if error:
            break
    await asyncio.wait_for(task, 10)
    return b"".join(chunks)


def test_reasoning_is_an_item_of_its_own() -> None:
    whole = json.loads(asyncio.run(_reasoning_answer(stream=False)))
    assert_valid(whole, "Response")
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "Hi there" and whole["status"] == "completed"
    assert 0 < whole["usage"]["output_tokens_details"]["reasoning_tokens"] < whole["usage"]["output_tokens"]
    raw = asyncio.run(_reasoning_answer(stream=True))
    events = [json.loads(record.split("\n")[1].removeprefix("data: ")) for record in raw.decode().split("\n\n")[:-1]]
    streamed = check_stream(events)
    assert [item["type"] for item in streamed["output"]] == ["reasoning", "message"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "hmm"
    assert streamed["output"][0]["content"] == reasoning["content"] and output_text(streamed) == "Hi there"


def test_a_failure_after_the_stream_started_is_response_failed() -> None:
    raw = asyncio.run(_reasoning_answer(stream=True, fail=True))
    events = [json.loads(record.split("\n")[1].removeprefix("data: ")) for record in raw.decode().split("\n\n")[:-1]]
    for event in events:
        assert_valid(event, EVENT_SCHEMAS[event["type"]])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "boom" in failed["error"]["message"]
