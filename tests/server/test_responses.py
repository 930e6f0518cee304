"""POST /v1/responses (OpenAI's Responses API) on the tiny random model, with the unmodified openai SDK against a
real server: the same text and token counts as /v1/chat/completions, streams whose events follow the spec and
join into the whole answer, structured output through responses.parse, forced tool calls, and the stored
responses (retrieve, input_items, delete, previous_response_id, eviction)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_NAME, start_server
from tests.server.openapi import assert_valid
from tests.server.prom import scrape
from tests.server.responses_events import check_stream, output_text, raw_events
from tests.server.server_proc import ServerProcess

STORE_SIZE = 3
INSTRUCTIONS = "You are terse."
INPUT = [{"role": "user", "content": "Tell me about the sea."},
         {"role": "assistant", "content": "It is big."},
         {"role": "user", "content": [{"type": "input_text", "text": "And"}, {"type": "input_text", "text": "the sky?"}]}]
# The same conversation as chat messages (text parts join with a newline, as chat's content parts do).
CHAT_MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, INPUT[0], INPUT[1],
                 {"role": "user", "content": "And\nthe sky?"}]
TIME = {"type": "function", "name": "get_time", "description": "The time in a zone.", "strict": True,
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
                       "required": ["zone"], "additionalProperties": False}}
GREEDY = {"model": MODEL_NAME, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:
    # tool_choice auto needs a parser: the tiny template writes hermes calls. A longer context than the
    # default: the template lists the tools in the prompt.
    proc = start_server(tiny_checkpoint, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-model-len", "512", "--responses-store-size", str(STORE_SIZE))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={**GREEDY, "messages": messages, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_answer_is_chats_answer(client: openai.OpenAI, http: httpx.Client) -> None:
    response = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=INPUT, temperature=0,
                                       max_output_tokens=12, metadata={"case": "1"}, user="u-1")
    expected = chat(http, CHAT_MESSAGES, max_tokens=12)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == expected["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == expected["usage"]["completion_tokens"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    # echoed as sent
    assert (response.instructions, response.metadata, response.user) == (INSTRUCTIONS, {"case": "1"}, "u-1")
    assert response.max_output_tokens == 12 and response.temperature == 0 and response.tool_choice == "auto"
    assert_valid(http.get(f"/v1/responses/{response.id}").json(), "Response")     # the body as it was sent
    if expected["choices"][0]["finish_reason"] == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_a_repeated_prompt_reports_cached_tokens(http: httpx.Client) -> None:
    body = {**GREEDY, "input": "The prefix cache keeps whole blocks of sixteen tokens. " * 6, "max_output_tokens": 2}
    first = http.post("/v1/responses", json=body).json()["usage"]
    again = http.post("/v1/responses", json=body).json()["usage"]
    assert first["input_tokens"] == again["input_tokens"] > 64
    # at least the whole blocks before the last prompt token (always computed) are found again
    assert again["input_tokens_details"]["cached_tokens"] >= (again["input_tokens"] - 1) // 16 * 16 - 16 > 0


def test_a_string_input_is_one_user_message(http: httpx.Client) -> None:
    body = http.post("/v1/responses", json={**GREEDY, "input": "Hello", "max_output_tokens": 5}).json()
    assert_valid(body, "Response")
    assert output_text(body) == chat(http, [{"role": "user", "content": "Hello"}], max_tokens=5)[
        "choices"][0]["message"]["content"]


def test_a_cut_answer_is_incomplete(http: httpx.Client) -> None:
    body = {**GREEDY, "input": "Count", "max_output_tokens": 3,
            "text": {"format": {"type": "json_schema", "name": "digits", "schema": {
                "type": "object", "properties": {"n": {"type": "string", "pattern": "^[0-9]{50}$"}},
                "required": ["n"]}}}}
    response = http.post("/v1/responses", json=body).json()
    assert_valid(response, "Response")
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete" and response["usage"]["output_tokens"] == 3
    streamed = check_stream(raw_events(http, body))
    assert streamed["status"] == "incomplete" and output_text(streamed) == output_text(response)


def test_the_stream_joins_into_the_whole_answer(http: httpx.Client) -> None:
    body = {**GREEDY, "instructions": INSTRUCTIONS, "input": INPUT, "max_output_tokens": 16}
    events = raw_events(http, body)
    response = check_stream(events)
    whole = http.post("/v1/responses", json=body).json()
    assert output_text(response) == output_text(whole)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == output_text(whole)
    assert response["usage"] == whole["usage"] and response["status"] == whole["status"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def test_the_sdk_streams(client: openai.OpenAI) -> None:
    # The SDK's stream wants response.completed: a short schema makes the random model finish.
    with client.responses.stream(model=MODEL_NAME, input="Hi there", temperature=0, max_output_tokens=40,
                                 text_format=Verdict) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.usage.output_tokens > 0
    assert isinstance(final.output_parsed, Verdict)
    events = list(client.responses.create(model=MODEL_NAME, input="Hi there", temperature=0, max_output_tokens=10,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text


def test_parse_returns_the_pydantic_model(client: openai.OpenAI) -> None:
    response = client.responses.parse(model=MODEL_NAME, input="Is the sea big?", text_format=Verdict,
                                      temperature=0, max_output_tokens=40)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Verdict)
    assert response.text.format.type == "json_schema" and response.text.format.name == "Verdict"


def test_json_object_output(http: httpx.Client) -> None:
    body = {**GREEDY, "input": "JSON please", "max_output_tokens": 60, "text": {"format": {"type": "json_object"}}}
    response = http.post("/v1/responses", json=body).json()
    if response["status"] == "completed":
        assert isinstance(json.loads(output_text(response)), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_a_forced_tool_call_is_a_function_call_item(client: openai.OpenAI, http: httpx.Client, choice) -> None:
    response = client.responses.create(model=MODEL_NAME, input="What time is it in zone 3?", tools=[TIME],
                                       tool_choice=choice, temperature=0, max_output_tokens=60)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_time" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert -12 <= json.loads(call.arguments)["zone"] <= 12
    assert_valid(http.get(f"/v1/responses/{response.id}").json(), "Response")
    streamed = check_stream(raw_events(http, {**GREEDY, "input": "What time is it in zone 3?", "tools": [TIME],
                                              "tool_choice": choice, "max_output_tokens": 60}))
    [streamed_call] = streamed["output"]
    assert streamed_call["arguments"] == call.arguments and streamed_call["name"] == "get_time"
    assert streamed["tools"] == [TIME] and streamed["tool_choice"] == choice


def test_a_tool_round_trip_with_previous_response_id_or_the_whole_list(client: openai.OpenAI,
                                                                       http: httpx.Client) -> None:
    first = client.responses.create(model=MODEL_NAME, input="What time is it in zone 3?", tools=[TIME],
                                    tool_choice="required", temperature=0, max_output_tokens=60)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "noon"}
    chained = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=[result],
                                      tools=[TIME], tool_choice="none", temperature=0, max_output_tokens=8)
    # the whole list, as a client without stored responses sends it: earlier output items sent back as they came
    items = [{"role": "user", "content": "What time is it in zone 3?"},
             *[item.model_dump(exclude_none=True) for item in first.output], result]
    whole = client.responses.create(model=MODEL_NAME, input=items, tools=[TIME], tool_choice="none",
                                    temperature=0, max_output_tokens=8)
    assert chained.previous_response_id == first.id
    assert chained.output_text == whole.output_text
    assert chained.usage.input_tokens == whole.usage.input_tokens
    tool_call = {"id": call.call_id, "type": "function",
                 "function": {"name": "get_time", "arguments": call.arguments}}
    expected = chat(http, [{"role": "user", "content": "What time is it in zone 3?"},
                           {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                           {"role": "tool", "content": "noon", "tool_call_id": call.call_id}],
                    tools=[{"type": "function", "function": {k: TIME[k] for k in ("name", "description",
                                                                                "parameters", "strict")}}],
                    tool_choice="none", max_tokens=8)
    assert whole.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert whole.output_text == expected["choices"][0]["message"]["content"]


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, http: httpx.Client) -> None:
    first = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=INPUT[0]["content"],
                                    temperature=0, max_output_tokens=6)
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input="And the sky?",
                                     temperature=0, max_output_tokens=6)
    # instructions are not carried over (OpenAI's rule); earlier input and output are
    expected = chat(http, [INPUT[0], {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "And the sky?"}], max_tokens=6)
    assert second.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert second.output_text == expected["choices"][0]["message"]["content"]
    third = client.responses.create(model=MODEL_NAME, previous_response_id=second.id, input="Why?",
                                    temperature=0, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_stored_responses_are_retrieved_listed_and_deleted(client: openai.OpenAI, http: httpx.Client) -> None:
    created = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=INPUT, temperature=0,
                                      max_output_tokens=4)
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    listed = client.responses.input_items.list(created.id, order="asc")
    assert [item.role for item in listed.data] == ["user", "assistant", "user"]
    assert listed.data[0].content[0].type == "input_text" and listed.data[0].content[0].text == INPUT[0]["content"]
    assert listed.data[1].content[0].type == "output_text"
    assert listed.first_id == listed.data[0].id and listed.last_id == listed.data[-1].id and not listed.has_more
    assert_valid(http.get(f"/v1/responses/{created.id}/input_items").json(), "ResponseItemList")
    newest = client.responses.input_items.list(created.id, limit=2)     # OpenAI's default order: newest first
    assert [i.id for i in newest.data] == [listed.data[2].id, listed.data[1].id] and newest.has_more
    rest = client.responses.input_items.list(created.id, limit=2, after=newest.last_id)
    assert [i.id for i in rest.data] == [listed.data[0].id] and not rest.has_more
    # the SDK's auto-pagination walks the pages
    assert [i.id for i in client.responses.input_items.list(created.id, limit=1)] == [
        i.id for i in reversed(listed.data)]
    deleted = client.responses.delete(created.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_store_false_is_not_kept(client: openai.OpenAI, http: httpx.Client) -> None:
    response = client.responses.create(model=MODEL_NAME, input="Hi", store=False, max_output_tokens=2)
    assert response.store is False
    assert http.get(f"/v1/responses/{response.id}").status_code == 404
    follow = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "previous_response_id": response.id})
    assert follow.status_code == 400 and follow.json()["error"]["code"] == "previous_response_not_found"


def test_the_oldest_stored_response_is_evicted_first(http: httpx.Client) -> None:
    ids: list[str] = []
    for i in range(STORE_SIZE + 2):
        if i % 2:   # streamed responses are stored too
            ids.append(check_stream(raw_events(http, {"model": MODEL_NAME, "input": f"n{i}",
                                                      "max_output_tokens": 1}))["id"])
        else:
            ids.append(http.post("/v1/responses", json={"model": MODEL_NAME, "input": f"n{i}",
                                                        "max_output_tokens": 1}).json()["id"])
    found = [http.get(f"/v1/responses/{i}").status_code for i in ids]
    assert found == [404, 404] + [200] * STORE_SIZE


def test_requests_and_tokens_are_counted_under_the_endpoint(http: httpx.Client) -> None:
    before = scrape(http)
    body = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "count me", "max_output_tokens": 3}).json()
    check_stream(raw_events(http, {"model": MODEL_NAME, "input": "count me", "max_output_tokens": 3}))
    after = scrape(http)

    def grew(kind: str) -> float:
        key = f"pagedserve_endpoint_{kind}_total{{/v1/responses}}"
        return after[key] - before.get(key, 0.0)

    assert grew("requests") == 2
    assert grew("prompt_tokens") == 2 * body["usage"]["input_tokens"]
    assert grew("generation_tokens") >= body["usage"]["output_tokens"]
