"""Bad input -> 4xx with the OpenAI error envelope, never a 500; the server keeps serving."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, start_server
from tests.server.openapi import assert_valid

BODY_LIMIT = 64 * 1024
OK_COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    proc = start_server(tiny_checkpoint, "--max-body-bytes", str(BODY_LIMIT))
    yield proc
    proc.stop()


def check_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert_valid(body, "ErrorResponse")
    assert "Traceback" not in response.text and body["error"]["message"]
    return body["error"]


BAD_COMPLETIONS = {
    "temperature is a string": {"temperature": "hot"},
    "temperature below 0": {"temperature": -0.5},
    "top_p above 1": {"top_p": 1.5},
    "n is 0": {"n": 0},
    "n too large": {"n": 1000},
    "max_tokens is 0": {"max_tokens": 0},
    "max_tokens negative": {"max_tokens": -3},
    "max_tokens is a float": {"max_tokens": 2.5},
    "empty prompt": {"prompt": ""},
    "empty prompt list": {"prompt": []},
    "empty token prompt": {"prompt": [[]]},
    "token id out of vocabulary": {"prompt": [10_000_000]},
    "echo of a token id out of vocabulary": {"prompt": [10_000_000], "echo": True},
    "negative token id": {"prompt": [-1]},
    "prompt of the wrong type": {"prompt": {"text": "hi"}},
    "logprobs above 5": {"logprobs": 6},
    "stream_options without stream": {"stream_options": {"include_usage": True}},
    "logit_bias key not a token id": {"logit_bias": {"abc": 1}},
    "logit_bias value out of range": {"logit_bias": {"5": 500}},
    "seed beyond int64": {"seed": 2**64},
    "too many stop strings": {"stop": [f"s{i}" for i in range(40)]},
    "stop of the wrong type": {"stop": 5},
    "presence_penalty out of range": {"presence_penalty": 3.0},
    "best_of other than n": {"best_of": 3},
    "min_tokens above max_tokens": {"min_tokens": 5},
    "stop_token_ids out of vocabulary": {"stop_token_ids": [10_000_000]},
}

BAD_CHATS = {
    "no messages": {"messages": []},
    "messages missing": {"messages": None},
    "message without role": {"messages": [{"content": "hi"}]},
    "top_logprobs without logprobs": {"top_logprobs": 2},
    "top_logprobs above 20": {"logprobs": True, "top_logprobs": 21},
    "image content": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    "json response_format": {"response_format": {"type": "json_object"}},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD_COMPLETIONS))
def test_bad_completion_requests(http: httpx.Client, case: str, stream: bool) -> None:
    body = {**OK_COMPLETION, **BAD_COMPLETIONS[case], "stream": stream}
    if case == "stream_options without stream":
        body["stream"] = False
    error = check_error(http.post("/v1/completions", json=body), 400)   # plain JSON, even for stream=true
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chat_requests(http: httpx.Client, case: str) -> None:
    body = {k: v for k, v in {**OK_CHAT, **BAD_CHATS[case]}.items() if v is not None}
    error = check_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"


def test_context_length_error_states_both_numbers(http: httpx.Client) -> None:
    prompt = [5] * 100
    error = check_error(http.post("/v1/completions", json={**OK_COMPLETION, "prompt": prompt, "max_tokens": 200}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and "300" in error["message"]
    too_long = [5] * MAX_MODEL_LEN
    check_error(http.post("/v1/completions", json={**OK_COMPLETION, "prompt": too_long, "max_tokens": 1}), 400)


def test_malformed_bodies(http: httpx.Client) -> None:
    check_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    check_error(http.post("/v1/completions", json=[1, 2, 3]), 400)
    check_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400)   # no prompt
    response = http.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert 400 <= response.status_code < 500


def test_unknown_model_route_and_method(http: httpx.Client) -> None:
    error = check_error(http.post("/v1/completions", json={**OK_COMPLETION, "model": "gpt-17"}), 404)
    assert error["param"] == "model" and "gpt-17" in error["message"]
    check_error(http.post("/v1/chat/completions", json={**OK_CHAT, "model": "gpt-17"}), 404)
    check_error(http.get("/v1/no-such-route"), 404)
    check_error(http.get("/v1/completions"), 405)


def test_body_too_large(http: httpx.Client) -> None:
    big = {**OK_COMPLETION, "prompt": "x" * (BODY_LIMIT + 10)}
    assert str(BODY_LIMIT) in check_error(http.post("/v1/completions", json=big), 413)["message"]

    def chunks():   # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'
    chunked = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert str(BODY_LIMIT) in check_error(chunked, 413)["message"]


def test_unknown_fields_are_ignored_and_model_may_be_omitted(http: httpx.Client) -> None:
    body = {**OK_COMPLETION, "frobnicate": True, "metadata": {"a": 1}}
    del body["model"]
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["model"] == MODEL_NAME
    chat = {**OK_CHAT, "model": "", "tools": [], "messages": [{"role": "user", "content": "Hi", "extra": 1}]}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_server_still_serves_after_errors(http: httpx.Client) -> None:
    for _ in range(3):
        check_error(http.post("/v1/completions", json={**OK_COMPLETION, "n": -1}), 400)
    response = http.post("/v1/completions", json={**OK_COMPLETION, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").status_code == 200
