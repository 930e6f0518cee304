"""/v1/chat/completions against the real server (tiny random checkpoint, CPU)."""
from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, pick_stop
from tests.server.openapi import assert_valid
from tests.server.sse import stream_events, texts_by_index

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True, "messages": MESSAGES}


@pytest.fixture(scope="module")
def prompt_len(tiny_checkpoint) -> int:
    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def chat(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/chat/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    assert_valid(data, "CreateChatCompletionResponse")
    return data


def test_chat_non_stream_and_stream_agree(http: httpx.Client, prompt_len: int) -> None:
    data = chat(http, max_completion_tokens=8)
    [choice] = data["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert data["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 8, "total_tokens": prompt_len + 8}
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"

    events = stream_events(http, "/v1/chat/completions",
                           {**GREEDY, "max_completion_tokens": 8, "stream_options": {"include_usage": True}})
    for event in events:
        assert_valid(event, "CreateChatCompletionStreamResponse")
        assert event["object"] == "chat.completion.chunk" and event["id"] == events[0]["id"]
    *chunks, usage = events
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["delta"] for e in chunks[1:] for c in e["choices"])
    finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert texts_by_index(chunks, "content") == {0: choice["message"]["content"]}
    assert usage["choices"] == [] and usage["usage"] == data["usage"]
    assert all("usage" not in e for e in chunks)


def test_max_tokens_defaults_to_the_context(http: httpx.Client, prompt_len: int) -> None:
    data = chat(http)
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["total_tokens"] == MAX_MODEL_LEN
    # max_completion_tokens wins over the deprecated max_tokens.
    assert chat(http, max_tokens=3, max_completion_tokens=5)["usage"]["completion_tokens"] == 5
    assert chat(http, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_n_and_multi_turn(http: httpx.Client) -> None:
    first = chat(http, max_completion_tokens=4, n=3)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in first["choices"]}) == 1    # greedy
    reply = first["choices"][0]["message"]["content"]
    follow_up = MESSAGES + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another."}]
    longer = chat(http, messages=follow_up, max_completion_tokens=4)
    assert longer["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    # Content parts render like the plain string.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    plain = [{"role": "user", "content": "Name a colour."}]
    assert (chat(http, messages=parts, max_completion_tokens=4)["choices"][0]["message"]
            == chat(http, messages=plain, max_completion_tokens=4)["choices"][0]["message"])


def test_chat_logprobs(http: httpx.Client) -> None:
    data = chat(http, max_completion_tokens=5, logprobs=True, top_logprobs=3)
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        raw = bytes(entry["bytes"])
        if entry["token"].startswith("bytes:"):     # part of a character: named by its bytes
            assert entry["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert raw.decode("utf-8") == entry["token"]
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-5)   # greedy
    assert chat(http, max_completion_tokens=2, logprobs=True)["choices"][0]["logprobs"]["content"][0][
        "top_logprobs"] == []
    events = stream_events(http, "/v1/chat/completions",
                           {**GREEDY, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3})
    streamed = [t["token"] for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["content"]]
    assert streamed == [entry["token"] for entry in content]


def test_chat_stop_string_stream_and_not(http: httpx.Client) -> None:
    full = chat(http, max_completion_tokens=20)["choices"][0]["message"]["content"]
    stop = pick_stop(full)
    expected = full[:full.index(stop)]
    data = chat(http, max_completion_tokens=20, stop=stop)
    assert data["choices"][0]["message"]["content"] == expected
    assert data["choices"][0]["finish_reason"] == "stop"
    events = stream_events(http, "/v1/chat/completions", {**GREEDY, "max_completion_tokens": 20, "stop": stop})
    assert texts_by_index(events, "content") == {0: expected}


def test_openai_sdk_chat_stream(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=6,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=6, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
