"""/v1/messages refuses what it cannot honour with a 400 in Anthropic's error shape (never a 500, never a silent
drop), and every failure on its paths, also those met before the route runs (API key, body size, unknown
path), is in that shape; /v1/chat/completions keeps the OpenAI envelope. x-api-key works beside Bearer."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from server.errors import error_response, is_anthropic_path
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.server_proc import ServerProcess

VALID = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "integer"}}}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": 1}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}

# name -> (fields merged into VALID, None to delete a field; a word the message must hold)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "max_tokens missing": ({"max_tokens": None}, "max_tokens"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"max_tokens": -5}, "max_tokens"),
    "max_tokens a string": ({"max_tokens": "4"}, "max_tokens"),
    "max_tokens beyond the context": ({"max_tokens": 10**6}, "context"),
    "model missing": ({"model": None}, "model"),
    "messages not a list": ({"messages": "Hi"}, "messages"),
    "messages empty": ({"messages": []}, "messages"),
    "a system role in messages": ({"messages": [{"role": "system", "content": "Hi"}]}, "role"),
    "an unknown role": ({"messages": [{"role": "tool", "content": "Hi"}]}, "role"),
    "content missing": ({"messages": [{"role": "user"}]}, "content"),
    "content an empty list": ({"messages": [{"role": "user", "content": []}]}, "content"),
    "ends with the assistant (prefill)": ({"messages": [{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": "Hel"}]}, "prefill"),
    "an image block": ({"messages": [{"role": "user", "content": [IMAGE]}]}, "image"),
    "a document block": ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
                         "document"),
    "a text block without text": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    "tool_use in a user message": ({"messages": [{"role": "user", "content": [CALL]}]}, "tool_use"),
    "tool_result for no call": ({"messages": [{"role": "user", "content": [RESULT]}]}, "toolu_1"),
    "system of the wrong type": ({"system": 5}, "system"),
    "temperature above 1": ({"temperature": 1.5}, "temperature"),
    "temperature a string": ({"temperature": "0.5"}, "temperature"),
    "top_k negative": ({"top_k": -1}, "top_k"),
    "stop_sequences not a list": ({"stop_sequences": 5}, "stop_sequences"),
    "an unknown field": ({"frobnicate": True}, "frobnicate"),
    "thinking": ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    "stream a string": ({"stream": "yes"}, "stream"),
    "tool without input_schema": ({"tools": [{"name": "f"}], "tool_choice": {"type": "any"}}, "input_schema"),
    "input_schema not an object schema": ({"tools": [{"name": "f", "input_schema": {"type": "string"}}],
                                           "tool_choice": {"type": "any"}}, "object"),
    "input_schema with a bad type": ({"tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}], "tool_choice": {"type": "any"}}, "f"),
    "a bad tool name": ({"tools": [{**TOOL, "name": "no spaces"}], "tool_choice": {"type": "any"}}, "name"),
    "the same tool twice": ({"tools": [TOOL, TOOL], "tool_choice": {"type": "any"}}, "twice"),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    "tool_choice naming an unknown tool": ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
                                           "nope"),
    "tool_choice tool without a name": ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "name"),
    "tool_choice of an unknown type": ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    "tool_choice without tools": ({"tool_choice": {"type": "any"}}, "tools"),
    "tool_choice auto on a server without a parser": ({"tools": [TOOL]}, "auto"),
    "over-long input": ({"messages": [{"role": "user", "content": "word " * 50_000}]}, "context"),
}


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    body = {**VALID, **fields}
    return {k: v for k, v in body.items() if v is not None}


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, word: str = "") -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert word.lower() in body["error"]["message"].lower(), body
    assert "Traceback" not in response.text


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_in_anthropic_shape(http: httpx.Client, case: str) -> None:
    fields, word = BAD[case]
    assert_anthropic_error(http.post("/v1/messages", json=_body(fields)), 400, "invalid_request_error", word)


def test_the_server_stays_healthy_and_counts_tokens_strictly(server: ServerProcess, http: httpx.Client) -> None:
    prompt = {k: v for k, v in VALID.items() if k != "max_tokens"}
    for path, body in (("/v1/messages", VALID), ("/v1/messages/count_tokens", prompt)):
        assert_anthropic_error(http.post(path, content=b"{not json", headers={"content-type": "application/json"}),
                               400, "invalid_request_error", "JSON")
        assert_anthropic_error(http.post(path, json={**body, "model": "other"}), 404, "not_found_error", "other")
        assert_anthropic_error(http.post(path, json={**body, "messages": [{"role": "user", "content": [IMAGE]}]}),
                               400, "invalid_request_error", "image")
    # count_tokens takes the prompt's fields only (Anthropic's does too).
    assert_anthropic_error(http.post("/v1/messages/count_tokens", json=VALID), 400, "invalid_request_error",
                           "max_tokens")
    assert http.post("/v1/messages/count_tokens", json=prompt).json()["input_tokens"] > 0
    assert_anthropic_error(http.get("/v1/messages/nothing"), 404, "not_found_error")
    assert_anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    # The SDK reads the shape: its own exception, with the server's message.
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}])
    assert http.get("/health").status_code == 200
    assert "Traceback" not in server.log_tail(200_000)


def test_statuses_map_to_anthropic_error_types() -> None:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
             504: "timeout_error"}
    for status, kind in kinds.items():
        response = error_response(status, "m", path="/v1/messages", headers={"Retry-After": "1"})
        assert response.status_code == status and response.headers["retry-after"] == "1"
        assert response.body == b'{"type":"error","error":{"type":"%s","message":"m"}}' % kind.encode()
    assert is_anthropic_path("/v1/messages/count_tokens") and not is_anthropic_path("/v1/messagesx")
    assert b'"error":{"message":"m"' in error_response(429, "m", path="/v1/chat/completions").body


KEY = "sk-messages-test-key"


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint) -> Iterator[ServerProcess]:
    proc = start_server(tiny_checkpoint, "--max-body-bytes", "65536", env={"PAGEDSERVE_API_KEY": KEY})
    yield proc
    proc.stop()


def test_api_key_by_either_header_and_errors_in_each_shape(keyed: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=keyed.base_url, api_key=KEY, max_retries=0)   # sends x-api-key
    assert client.messages.create(**VALID).stop_reason == "max_tokens"
    assert client.messages.count_tokens(model=MODEL_NAME, messages=VALID["messages"]).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=keyed.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**VALID)
    assert refused.value.body["error"]["type"] == "authentication_error"
    with httpx.Client(base_url=keyed.base_url, timeout=60.0) as http:
        chat = {"model": MODEL_NAME, "max_tokens": 2, "messages": VALID["messages"]}
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            assert http.post("/v1/messages", json=VALID, headers=headers).status_code == 200
            assert http.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                assert_anthropic_error(http.post(path, json=VALID, headers=headers), 401, "authentication_error",
                                       "x-api-key")
            openai_shape = http.post("/v1/chat/completions", json=chat, headers=headers)
            assert openai_shape.status_code == 401
            assert openai_shape.json()["error"]["type"] == "authentication_error"
            assert openai_shape.json()["error"]["code"] == "invalid_api_key"
        # The body limit, before the route runs, in the route's shape.
        big = {**VALID, "messages": [{"role": "user", "content": "x" * 70_000}]}
        assert_anthropic_error(http.post("/v1/messages", json=big, headers={"x-api-key": KEY}), 413,
                               "invalid_request_error", "limit")
        assert "type" not in http.post("/v1/chat/completions", json=big, headers={"x-api-key": KEY}).json()
        assert http.get("/health").status_code == 200
        doc = http.get("/openapi.json", headers={"x-api-key": KEY}).json()
        unauthorized = doc["paths"]["/v1/messages"]["post"]["responses"]["401"]
        assert unauthorized["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
