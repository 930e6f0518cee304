"""Bad input -> 4xx with the OpenAI error envelope, never a 500; the server keeps serving."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.bad_inputs import BAD_CHATS, BAD_COMPLETIONS, BAD_RAW_BODIES, BAD_UTILITY
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


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert_valid(body, "ErrorResponse")
    assert "Traceback" not in response.text and body["error"]["message"]
    return body["error"]


def assert_still_serving(http: httpx.Client) -> None:
    """After a bad request the engine must be alive: a normal request completes."""
    response = http.post("/v1/completions", json={**OK_COMPLETION, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_the_table_is_big_enough() -> None:
    assert len(BAD_COMPLETIONS) + len(BAD_CHATS) + len(BAD_RAW_BODIES) + len(BAD_UTILITY) >= 40


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD_COMPLETIONS))
def test_bad_completion_requests(http: httpx.Client, case: str, stream: bool) -> None:
    body = {**OK_COMPLETION, "stream": stream, **BAD_COMPLETIONS[case]}
    if case == "stream_options without stream":
        body["stream"] = False
    error = assert_error(http.post("/v1/completions", json=body), 400)   # plain JSON, even for stream=true
    assert error["type"] == "invalid_request_error"
    assert_still_serving(http)


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chat_requests(http: httpx.Client, case: str) -> None:
    body = {k: v for k, v in {**OK_CHAT, **BAD_CHATS[case]}.items() if v is not None}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert_still_serving(http)


@pytest.mark.parametrize("case", list(BAD_RAW_BODIES))
def test_bad_raw_bodies(http: httpx.Client, case: str) -> None:
    path, raw = BAD_RAW_BODIES[case]
    error = assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert "Traceback" not in error["message"] and len(error["message"]) < 500
    assert_still_serving(http)


@pytest.mark.parametrize("case", list(BAD_UTILITY))
def test_bad_tokenize_requests(http: httpx.Client, case: str) -> None:
    path, body = BAD_UTILITY[case]
    assert_error(http.post(path, json=body), 400)
    assert_still_serving(http)


def test_context_length_error_states_both_numbers(http: httpx.Client) -> None:
    prompt = [5] * 100
    error = assert_error(http.post("/v1/completions", json={**OK_COMPLETION, "prompt": prompt, "max_tokens": 200}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and "300" in error["message"]
    too_long = [5] * MAX_MODEL_LEN
    assert_error(http.post("/v1/completions", json={**OK_COMPLETION, "prompt": too_long, "max_tokens": 1}), 400)


def test_malformed_bodies(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", json=[1, 2, 3]), 400)
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400)   # no prompt
    response = http.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert 400 <= response.status_code < 500


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("headers", [{"content-type": "application/x-www-form-urlencoded"}, {}])
def test_a_body_not_declared_json_is_told_to_send_json(http: httpx.Client, path: str, headers: dict) -> None:
    """What `curl -d '{...}'` without -H sends: the message says what to do, whatever the body holds."""
    body = json.dumps({**OK_COMPLETION, "messages": [{"role": "user", "content": "hi"}], "tokens": [1]}).encode()
    request = http.build_request("POST", path, content=body, headers=headers)
    assert request.headers.get("content-type") == headers.get("content-type")    # none when none is given
    error = assert_error(http.send(request), 400)
    assert "Content-Type: application/json" in error["message"] and "JSON" in error["message"]
    assert_still_serving(http)


def test_unknown_model_route_and_method(http: httpx.Client) -> None:
    error = assert_error(http.post("/v1/completions", json={**OK_COMPLETION, "model": "gpt-17"}), 404)
    assert error["param"] == "model" and "gpt-17" in error["message"]
    assert_error(http.post("/v1/chat/completions", json={**OK_CHAT, "model": "gpt-17"}), 404)
    assert_error(http.get("/v1/no-such-route"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.post("/tokenize", json={"model": "gpt-17", "prompt": "hi"}), 404)
    # The fault-injection routes exist only when PAGEDSERVE_ENABLE_FAULT_INJECTION=1 at startup.
    assert_error(http.post("/_fault/kill"), 404)
    assert http.get("/health").status_code == 200


def test_body_too_large(http: httpx.Client) -> None:
    big = {**OK_COMPLETION, "prompt": "x" * (BODY_LIMIT + 10)}
    assert str(BODY_LIMIT) in assert_error(http.post("/v1/completions", json=big), 413)["message"]

    def chunks():   # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'
    chunked = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert str(BODY_LIMIT) in assert_error(chunked, 413)["message"]


def test_oversized_headers(http: httpx.Client) -> None:
    """uvicorn reads even a 1 MB header; the server refuses such requests (431) and goes on."""
    for headers in ({"X-Big": "a" * 1_000_000}, {f"X-H{i}": "1" for i in range(300)}):
        assert_error(http.post("/v1/completions", json=OK_COMPLETION, headers=headers), 431)
    assert_still_serving(http)


def test_unknown_fields_are_ignored_and_model_may_be_omitted(http: httpx.Client) -> None:
    body = {**OK_COMPLETION, "frobnicate": True, "metadata": {"a": 1}}
    del body["model"]
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["model"] == MODEL_NAME
    chat = {**OK_CHAT, "model": "", "tools": [], "messages": [{"role": "user", "content": "Hi", "extra": 1}]}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_server_still_serves_after_errors(http: httpx.Client) -> None:
    for _ in range(3):
        assert_error(http.post("/v1/completions", json={**OK_COMPLETION, "n": -1}), 400)
    response = http.post("/v1/completions", json={**OK_COMPLETION, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").status_code == 200


def test_a_subnormal_float_does_not_take_the_engine_down(http: httpx.Client) -> None:
    """5e-324 is a valid top_p to the front end; code loaded into the engine process may flush it to 0.0 when
    the request is decoded there. Either it runs, or that request alone is refused; the engine goes on."""
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "top_p": 5e-324, "repetition_penalty": 5e-324}
    response = http.post("/v1/completions", json=body)
    assert response.status_code in (200, 400), response.text
    assert http.get("/health").status_code == 200
    assert_still_serving(http)
