"""Tools reach every model: a chat template that drops tools (SmolLM2's, and a tiny model given the same kind of
template) gets them listed in a system message by the server, which reads hermes-style calls back; and a tool
call's streamed arguments join into exactly the non-streamed `arguments`, for every parser and tool_choice."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.default_model import DEFAULT_MODEL, default_model_file
from server.tool_parsers import ToolCallStream, extract_tool_calls
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.openapi import assert_valid
from tests.server.server_proc import ServerProcess
from tests.server.sse import stream_events

# A template of SmolLM2's kind: it renders the messages and nothing else.
PLAIN_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                  "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------------------------------- parsers alone
PARSED = [
    ("required", None, None,
     '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"zone": 2}}]'),
    ("named", "get_time", None, ' {"zone": 2}'),
    ("auto", None, "hermes", 'Sure. <tool_call>\n{"name": "get_time", "arguments":  {"zone": [1, {"a": "}"}]}}\n'
                             '</tool_call><tool_call>{"name": "x", "arguments": {}}</tool_call>'),
    ("auto", None, "llama3_json", '{"name": "get_time", "parameters": {"zone": 2}}; {"name": "x", "parameters": {"a": 1}}'),
]


@pytest.mark.parametrize(("kind", "name", "parser", "text"), PARSED)
def test_streamed_arguments_join_into_the_whole_ones(kind, name, parser, text) -> None:
    _, whole = extract_tool_calls(kind, text, name, parser)
    assert whole and all(json.loads(c.arguments) is not None for c in whole)
    assert all(c.arguments == c.arguments.strip() for c in whole)
    for size in range(1, len(text) + 1):        # every way of cutting the text into equal chunks
        stream, joined = ToolCallStream(kind, name, parser), {}
        for at in range(0, len(text), size):
            for delta in stream.feed(text[at:at + size])[1]:
                joined[delta["index"]] = joined.get(delta["index"], "") + delta["function"].get("arguments", "")
        stream.flush()
        assert [joined[i] for i in sorted(joined)] == [c.arguments for c in whole], size


# ------------------------------------------------------------------------------------------- over HTTP
def chat(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/chat/completions", json={"temperature": 0.0, "max_tokens": 40, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    assert_valid(data, "CreateChatCompletionResponse")
    return data


def streamed_calls(http: httpx.Client, **body) -> list[dict]:
    events = stream_events(http, "/v1/chat/completions", {"temperature": 0.0, "max_tokens": 40, **body})
    calls: dict[int, dict] = {}
    for event in events:
        for choice in event["choices"]:
            for delta in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                call["name"] += delta["function"].get("name") or ""
                call["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def check_tools_reach_the_model(http: httpx.Client, model: str) -> None:
    """The tools are in the prompt; required and named calls are valid and stream the same arguments."""
    plain = chat(http, model=model, messages=ASK, max_tokens=1)
    with_tools = chat(http, model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=1)
    schema_tokens = len(http.post("/tokenize", json={"prompt": json.dumps(WEATHER["function"])}).json()["tokens"])
    assert with_tools["usage"]["prompt_tokens"] >= plain["usage"]["prompt_tokens"] + schema_tokens
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = chat(http, model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80,
                     parallel_tool_calls=False)
        message = whole["choices"][0]["message"]
        assert whole["choices"][0]["finish_reason"] == "tool_calls" and message["tool_calls"]
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] in ("get_weather", "get_time") and isinstance(arguments, dict)
        streamed = streamed_calls(http, model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                  max_tokens=80, parallel_tool_calls=False)
        assert streamed == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                            for c in message["tool_calls"]]


@pytest.fixture(scope="module")
def plain_template_checkpoint(tiny_checkpoint: Path, tmp_path_factory) -> Path:
    """The tests' tiny checkpoint with a chat template that drops tools."""
    copy = tmp_path_factory.mktemp("plain-template") / "llama"
    shutil.copytree(tiny_checkpoint, copy)
    config_file = copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = PLAIN_TEMPLATE
    config_file.write_text(json.dumps(config))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    return copy


@pytest.fixture(scope="module")
def plain_server(plain_template_checkpoint: Path) -> Iterator[ServerProcess]:
    proc = start_server(plain_template_checkpoint, "--enable-auto-tool-choice", "--max-model-len", "512")
    yield proc
    proc.stop()


def test_tiny_model_whose_template_drops_tools(plain_server: ServerProcess) -> None:
    assert "chat template drops tools" in plain_server.log_tail(200_000)
    with httpx.Client(base_url=plain_server.base_url, timeout=60.0) as http:
        check_tools_reach_the_model(http, MODEL_NAME)
        # The client's own system message is kept, with the tools after it.
        system = [{"role": "system", "content": "Be brief."}, *ASK]
        own = chat(http, messages=system, max_tokens=1)["usage"]["prompt_tokens"]
        merged = chat(http, messages=system, tools=[WEATHER], tool_choice="auto", max_tokens=1)
        alone = chat(http, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=1)
        assert merged["usage"]["prompt_tokens"] > own
        assert merged["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"]


def test_tiny_model_whose_template_renders_tools(tiny_checkpoint: Path) -> None:
    proc = start_server(tiny_checkpoint, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-model-len", "512")
    try:
        assert "chat template renders tools" in proc.log_tail(200_000)
        with httpx.Client(base_url=proc.base_url, timeout=60.0) as http:
            check_tools_reach_the_model(http, MODEL_NAME)
    finally:
        proc.stop()


def test_default_model_sees_and_calls_tools() -> None:
    assert default_model_file() is not None, "the default model is not installed: run bash .ci/install"
    proc = ServerProcess("--model", DEFAULT_MODEL, "--device", "cpu", "--max-model-len", "1024",
                         "--enable-auto-tool-choice").wait_ready()
    try:
        assert "chat template drops tools" in proc.log_tail(200_000)
        with httpx.Client(base_url=proc.base_url, timeout=120.0) as http:
            check_tools_reach_the_model(http, DEFAULT_MODEL)
            reply = chat(http, messages=ASK, tools=[WEATHER], tool_choice="required")
            [call] = reply["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert "paris" in json.loads(call["function"]["arguments"])["city"].lower()
    finally:
        proc.stop()
