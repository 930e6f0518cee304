"""Structured outputs, tool calls and reasoning against the real server (tiny random model, CPU).

The random model's free text is noise, so every check below could fail if the constraint were not applied:
each sampled choice (temperature 1.0, n = 4) must parse and validate. Schemas bound their strings and
numbers, so that a constrained output can end within max_tokens.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME, start_server
from tests.server.prom import scrape
from tests.server.sse import stream_events, texts_by_index

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                             "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Answer."}]
SAMPLE = {"model": MODEL_NAME, "temperature": 1.0, "n": 4}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator:
    proc = start_server(tiny_checkpoint, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-model-len", "512")
    yield proc
    proc.stop()


@pytest.fixture
def reasoning_http(tiny_checkpoint: Path) -> Iterator[httpx.Client]:
    proc = start_server(tiny_checkpoint, "--reasoning-parser", "qwen3")
    try:
        with httpx.Client(base_url=proc.base_url, timeout=60.0) as client:
            yield client
    finally:
        proc.stop()


def chat(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/chat/completions", json={**SAMPLE, "messages": MESSAGES, "max_tokens": 80, **body})
    assert response.status_code == 200, response.text
    return response.json()


def completion(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={**SAMPLE, "prompt": "Go", "max_tokens": 60, **body})
    assert response.status_code == 200, response.text
    return response.json()


def assert_refused(http: httpx.Client, path: str, body: dict, words: str) -> None:
    base = {**SAMPLE, "max_tokens": 8, **({"messages": MESSAGES} if "chat" in path else {"prompt": "Go"})}
    response = http.post(path, json={**base, **body})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert re.search(words, message, re.IGNORECASE), message


def test_json_schema_chat_every_sample_validates(http: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    data = chat(http, response_format=fmt)
    streamed = stream_events(http, "/v1/chat/completions",
                             {**SAMPLE, "messages": MESSAGES, "max_tokens": 80, "response_format": fmt})
    texts = [c["message"]["content"] for c in data["choices"]] + list(texts_by_index(streamed, "content").values())
    assert len(texts) == 8
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert {c["finish_reason"] for c in data["choices"]} == {"stop"}


def test_json_object_and_structured_outputs_on_completions(http: httpx.Client) -> None:
    for choice in completion(http, response_format={"type": "json_object"}, max_tokens=40)["choices"]:
        if choice["finish_reason"] == "stop":       # an open object may not close within 40 tokens
            assert isinstance(json.loads(choice["text"]), dict)
        else:
            assert choice["text"].startswith("{")
    for choice in completion(http, structured_outputs={"json": PERSON})["choices"]:
        jsonschema.validate(json.loads(choice["text"]), PERSON)
    regex = r"[a-c]{2,5}-\d{3}( ok)?"
    assert all(re.fullmatch(regex, c["text"]) for c in completion(http, structured_outputs={"regex": regex})["choices"])
    streamed = stream_events(http, "/v1/completions", {**SAMPLE, "prompt": "Go", "max_tokens": 30,
                                                       "structured_outputs": {"regex": regex}})
    assert all(re.fullmatch(regex, t) for t in texts_by_index(streamed).values())
    choices = ["yes", "no", "ask \"me\" later"]
    picked = completion(http, structured_outputs={"choice": choices})["choices"]
    assert all(c["text"] in choices for c in picked)
    grammar = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
    for c in completion(http, structured_outputs={"grammar": grammar})["choices"]:
        assert re.fullmatch(r"\([1-9]\d{0,2}(\+[1-9]\d{0,2}){0,3}\)", c["text"]), c["text"]


def _check_calls(calls: list[dict], tools: list[dict]) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[call["function"]["name"]])


def test_tool_choice_required_and_named(http: httpx.Client) -> None:
    tools = [WEATHER, TIME]
    data = chat(http, tools=tools, tool_choice="required", parallel_tool_calls=False)
    for choice in data["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert len(choice["message"]["tool_calls"]) == 1
        _check_calls(choice["message"]["tool_calls"], tools)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in chat(http, tools=tools, tool_choice=named)["choices"]:
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        _check_calls([call], tools)
    # The legacy spelling maps onto the same thing.
    legacy = chat(http, functions=[t["function"] for t in tools], function_call={"name": "get_weather"})
    assert all(c["message"]["tool_calls"][0]["function"]["name"] == "get_weather" for c in legacy["choices"])


def test_streamed_tool_calls(http: httpx.Client) -> None:
    tools = [WEATHER, TIME]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        events = stream_events(http, "/v1/chat/completions", {**SAMPLE, "messages": MESSAGES, "max_tokens": 80,
                                                             "tools": tools, "tool_choice": choice})
        calls: dict[tuple[int, int], dict] = {}
        finishes = {}
        for event in events:
            for c in event["choices"]:
                for delta in c["delta"].get("tool_calls", []):
                    key = (c["index"], delta["index"])
                    if key not in calls:    # the first delta of a call: id, type and the whole name
                        assert delta["id"] and delta["type"] == "function" and delta["function"]["name"]
                        calls[key] = {"id": delta["id"], "type": "function",
                                      "function": {"name": delta["function"]["name"], "arguments": ""}}
                    else:
                        assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                    calls[key]["function"]["arguments"] += delta["function"].get("arguments", "")
                assert "content" not in c["delta"] or c["delta"]["content"] == ""
                if c["finish_reason"]:
                    finishes[c["index"]] = c["finish_reason"]
        assert finishes == {i: "tool_calls" for i in range(4)}
        _check_calls(list(calls.values()), tools)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    likes_cats: bool


def test_openai_sdk_parse_and_streamed_tool_calls(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    parsed = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, response_format=Person,
                                           n=4, temperature=1.0, max_completion_tokens=60)
    assert len(parsed.choices) == 4
    assert all(isinstance(c.message.parsed, Person) for c in parsed.choices)
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME],
                                        tool_choice="required", n=4, temperature=1.0,
                                        max_completion_tokens=80) as stream:
        final = stream.get_final_completion()
    assert len(final.choices) == 4
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls([c.model_dump() for c in choice.message.tool_calls], [WEATHER, TIME])


def test_tool_turns_render(http: httpx.Client) -> None:
    turns = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    short = chat(http, messages=MESSAGES, tools=[TIME], tool_choice="none", max_tokens=2, n=1)
    data = chat(http, messages=turns, tools=[TIME], tool_choice="none", max_tokens=2, n=1)
    assert data["usage"]["prompt_tokens"] > short["usage"]["prompt_tokens"] + 10
    assert "tool_calls" not in data["choices"][0]["message"]
    # tool_choice "auto" with a parser: free text, read by the hermes parser (noise holds no call).
    auto = chat(http, tools=[TIME], max_tokens=8, n=1)
    assert auto["choices"][0]["message"]["content"] and "tool_calls" not in auto["choices"][0]["message"]


def test_reasoning_parser_splits_think_block(reasoning_http: httpx.Client) -> None:
    http = reasoning_http
    # The prompt closes its reasoning, so the regex applies from the first token: it makes the model write a
    # think block, which the qwen3 parser moves out of content.
    messages = [{"role": "user", "content": "<think></think>"}]
    regex = r"<think>[a-z]{1,6}</think>[a-z]{1,6}"
    body = {"messages": messages, "structured_outputs": {"regex": regex}, "max_tokens": 40}
    for choice in chat(http, **body)["choices"]:
        message = choice["message"]
        assert re.fullmatch("[a-z]{1,6}", message["reasoning_content"]) and message["reasoning"] == message["reasoning_content"]
        assert re.fullmatch("[a-z]{1,6}", message["content"])
    events = stream_events(http, "/v1/chat/completions", {**SAMPLE, **body})
    reasoning: dict[int, str] = {}
    for event in events:
        for c in event["choices"]:
            reasoning[c["index"]] = reasoning.get(c["index"], "") + c["delta"].get("reasoning_content", "")
    contents = texts_by_index(events, "content")
    assert all(re.fullmatch("[a-z]{1,6}", reasoning[i]) and re.fullmatch("[a-z]{1,6}", contents[i]) for i in range(4))


def test_bad_constraints_are_400(http: httpx.Client) -> None:
    chat_path, comp = "/v1/chat/completions", "/v1/completions"
    assert_refused(http, comp, {"structured_outputs": {"json": {"type": "strin"}}}, "schema")
    assert_refused(http, comp, {"structured_outputs": {"json": {"type": "object", "properties": {"a": {
        "$ref": "#/nowhere"}}}}}, "schema")
    assert_refused(http, comp, {"structured_outputs": {"regex": "a(b"}}, "regex.*parenthesis")
    assert_refused(http, comp, {"structured_outputs": {"grammar": "root ::= ("}}, "grammar")
    assert_refused(http, comp, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one")
    assert_refused(http, comp, {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
                   "only one")
    assert_refused(http, comp, {"structured_outputs": {"json": "x" * 70000}}, "at most 65536")
    assert_refused(http, chat_path, {"response_format": {"type": "json_schema"}}, "json_schema")
    assert_refused(http, chat_path, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": "nope"}}}, "nope.*not in tools")
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
    assert_refused(http, chat_path, {"tools": [bad_params], "tool_choice": "required"}, "parameters")
    assert_refused(http, chat_path, {"tools": [WEATHER] * 2, "tool_choice": "required"}, "twice")
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert_refused(http, chat_path, {"tools": many, "tool_choice": "required"}, "at most 128")
    assert_refused(http, chat_path, {"tool_choice": "required"}, "needs tools")
    assert_refused(http, chat_path, {"tools": [WEATHER], "tool_choice": "required",
                                     "response_format": {"type": "json_object"}}, "only one")
    assert_refused(http, chat_path, {"function_call": "sometimes"}, "function_call")
    assert chat(http, max_tokens=2, n=1)["choices"][0]["finish_reason"] == "length"   # the server is fine


def test_metrics_count_constrained_requests_and_compiles(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"]}
    before = scrape(http)
    completion(http, structured_outputs={"json": schema}, n=1, prompt=["a", "b"])
    completion(http, structured_outputs={"json": schema}, n=2)       # the same schema: compiled once
    after = scrape(http)

    def delta(metric: str) -> float:
        return after.get(metric, 0.0) - before.get(metric, 0.0)
    assert delta("pagedserve_structured_output_requests_total") == 3
    assert delta("pagedserve_structured_output_compile_seconds_count") == 1
