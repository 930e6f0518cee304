"""/v1/responses refuses what it cannot honour with a 400 in the OpenAI error envelope (never a 500, never a
silent drop): malformed input, bad tool schemas, out-of-range numbers, built-in tools, unsupported fields and
values; unknown stored ids are 404s (an unknown previous_response_id a 400, as OpenAI answers); the server stays
healthy afterwards, and the SDK raises its own exceptions with the server's message."""
from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from server.responses_store import ResponseStore, StoredResponse
from tests.server.conftest import MODEL_NAME
from tests.server.openapi import assert_valid
from tests.server.server_proc import ServerProcess

VALID = {"model": MODEL_NAME, "max_output_tokens": 4, "input": "Hi"}
TOOL = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "integer"}}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{\"zone\": 1}"}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "noon"}
IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}

# name -> (fields merged into VALID, None to delete a field; a word the message must hold)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "input missing": ({"input": None}, "input"),
    "input a number": ({"input": 5}, "input"),
    "input an object": ({"input": {"role": "user", "content": "Hi"}}, "input"),
    "input an empty list": ({"input": []}, "input"),
    "input only an assistant message": ({"input": [{"role": "assistant", "content": "Hi"}]}, "user"),
    "a message without content": ({"input": [{"role": "user"}]}, "content"),
    "a message of an unknown role": ({"input": [{"role": "tool", "content": "Hi"}]}, "role"),
    "an image part": ({"input": [{"role": "user", "content": [IMAGE]}]}, "input_image"),
    "a file part": ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
    "an input_text part without text": ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "text"),
    "an item of an unknown type": ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "web_search_call"),
    "an item reference": ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    "a function_call_output for no call": ({"input": [RESULT]}, "call_1"),
    "a function_call without arguments": ({"input": [{**CALL, "arguments": None}, RESULT]}, "arguments"),
    "function_call arguments that are not JSON": ({"input": [{"role": "user", "content": "Hi"},
                                                             {**CALL, "arguments": "{oops"}, RESULT]}, "json"),
    "an unknown field in an item": ({"input": [{"role": "user", "content": "Hi", "frobnicate": 1}]}, "frobnicate"),
    "max_output_tokens zero": ({"max_output_tokens": 0}, "max_output_tokens"),
    "max_output_tokens negative": ({"max_output_tokens": -5}, "max_output_tokens"),
    "max_output_tokens a string": ({"max_output_tokens": "4"}, "max_output_tokens"),
    "max_output_tokens beyond the context": ({"max_output_tokens": 10**6}, "context"),
    "over-long input": ({"input": "word " * 50_000}, "context"),
    "temperature above 2": ({"temperature": 2.5}, "temperature"),
    "temperature a string": ({"temperature": "0.5"}, "temperature"),
    "top_p zero": ({"top_p": 0}, "top_p"),
    "instructions a number": ({"instructions": 5}, "instructions"),
    "stream a string": ({"stream": "yes"}, "stream"),
    "stream_options without stream": ({"stream_options": {"include_obfuscation": False}}, "stream"),
    "metadata with a number": ({"metadata": {"a": 1}}, "metadata"),
    "metadata too large": ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    "an unknown field": ({"frobnicate": True}, "frobnicate"),
    "background": ({"background": True}, "background"),
    "truncation auto": ({"truncation": "auto"}, "truncation"),
    "reasoning effort": ({"reasoning": {"effort": "high"}}, "reasoning"),
    "top_logprobs": ({"top_logprobs": 3}, "top_logprobs"),
    "include logprobs": ({"include": ["message.output_text.logprobs"]}, "include"),
    "a conversation": ({"conversation": "conv_1"}, "conversation"),
    "a prompt template": ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    "a built-in tool": ({"tools": [{"type": "web_search"}]}, "web_search"),
    "a file search tool": ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "file_search"),
    "a function tool without a name": ({"tools": [{"type": "function", "parameters": {}}],
                                        "tool_choice": "required"}, "name"),
    "a tool schema with a bad type": ({"tools": [{**TOOL, "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}], "tool_choice": "required"}, "get_time"),
    "a tool schema not an object": ({"tools": [{**TOOL, "parameters": "object"}], "tool_choice": "required"},
                                    "parameters"),
    "a bad tool name": ({"tools": [{**TOOL, "name": "no spaces"}], "tool_choice": "required"}, "name"),
    "the same tool twice": ({"tools": [TOOL, TOOL], "tool_choice": "required"}, "twice"),
    "tool_choice naming an unknown tool": ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
                                           "nope"),
    "tool_choice of a built-in type": ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}},
                                       "web_search_preview"),
    "tool_choice a made-up word": ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    "tool_choice required without tools": ({"tool_choice": "required"}, "tools"),
    "tool_choice auto on a server without a parser": ({"tools": [TOOL]}, "auto"),
    "text.format of an unknown type": ({"text": {"format": {"type": "yaml"}}}, "format"),
    "json_schema without a schema": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    "json_schema with a bad schema": ({"text": {"format": {"type": "json_schema", "name": "x",
                                                           "schema": {"type": "nonsense"}}}}, "schema"),
    "text.verbosity high": ({"text": {"verbosity": "high"}}, "verbosity"),
    "previous_response_id unknown": ({"previous_response_id": "resp_nope"}, "resp_nope"),
    "store a string": ({"store": "yes"}, "store"),
    "max_tool_calls": ({"max_tool_calls": 2}, "max_tool_calls"),
}
# What the SDKs send that asks for nothing this server does not do: accepted.
HARMLESS = {"include": ["reasoning.encrypted_content"], "truncation": "disabled", "reasoning": {}, "top_logprobs": 0,
            "background": False, "store": True, "prompt_cache_key": "k", "prompt_cache_retention": "in-memory",
            "safety_identifier": "s", "service_tier": "auto", "parallel_tool_calls": True, "user": "u",
            "metadata": {"a": "b"}, "text": {"format": {"type": "text"}, "verbosity": "medium"}, "tool_choice": "auto",
            "tools": []}


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    body = {**VALID, **fields}
    return {k: v for k, v in body.items() if v is not None}


def assert_openai_error(response: httpx.Response, status: int, word: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert_valid(response.json(), "ErrorResponse")
    error = response.json()["error"]
    assert word.lower() in error["message"].lower() or word == error["param"], error
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_in_the_openai_envelope(http: httpx.Client, case: str) -> None:
    fields, word = BAD[case]
    assert_openai_error(http.post("/v1/responses", json=_body(fields)), 400, word)


def test_harmless_fields_are_accepted(http: httpx.Client) -> None:
    response = http.post("/v1/responses", json={**VALID, **HARMLESS, "reasoning": {"effort": None, "summary": None}})
    assert response.status_code == 200, response.text
    assert_valid(response.json(), "Response")
    streamed = http.post("/v1/responses", json={**VALID, "stream": True, "stream_options": {"include_obfuscation": False}})
    assert streamed.status_code == 200 and streamed.text.endswith("\n\n")


def test_unknown_ids_and_the_server_stays_healthy(server: ServerProcess, http: httpx.Client) -> None:
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        error = assert_openai_error(http.request(method, path), 404, "resp_nope")
        assert error["type"] == "not_found_error"
    unknown = assert_openai_error(http.post("/v1/responses", json={**VALID, "previous_response_id": "resp_x"}), 400)
    assert unknown["code"] == "previous_response_not_found" and unknown["param"] == "previous_response_id"
    assert_openai_error(http.post("/v1/responses", json={**VALID, "model": "other"}), 404, "other")
    assert_openai_error(http.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"}),
                        400, "JSON")
    stored = http.post("/v1/responses", json=VALID).json()["id"]
    for query in ("limit=0", "limit=101", "order=sideways", "after=msg_nope"):
        assert_openai_error(http.get(f"/v1/responses/{stored}/input_items?{query}"), 400)
    assert_openai_error(http.get("/v1/responses"), 405)
    # The SDK reads the envelope: its own exceptions, with the server's message.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=MODEL_NAME, input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    assert client.responses.create(**VALID).usage.output_tokens > 0
    assert http.get("/health").status_code == 200
    assert "Traceback" not in server.log_tail(200_000)


def test_the_store_keeps_at_most_its_size() -> None:
    def stored(i: int) -> StoredResponse:
        return StoredResponse({"id": f"resp_{i}"}, [], [])

    store = ResponseStore(2)
    for i in range(3):
        store.put(stored(i))
    assert store.get("resp_0") is None and store.get("resp_1") and store.get("resp_2") and len(store) == 2
    assert store.delete("resp_1") and not store.delete("resp_1")
    off = ResponseStore(0)
    off.put(stored(0))
    assert off.get("resp_0") is None and len(off) == 0
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_the_store_size_flag(monkeypatch) -> None:
    from server.cli import build_parser
    from server.settings import resolve_settings

    parser = build_parser()
    assert resolve_settings(parser.parse_args(["serve"]), {}).responses_store_size == 1000
    args = parser.parse_args(["serve", "--responses-store-size", "0"])
    assert resolve_settings(args, {}).responses_store_size == 0
    assert resolve_settings(parser.parse_args(["serve"]), {"PAGEDSERVE_RESPONSES_STORE_SIZE": "7"}
                            ).responses_store_size == 7
    with pytest.raises((SystemExit, ValueError)):
        resolve_settings(parser.parse_args(["serve", "--responses-store-size", "-1"]), {})
