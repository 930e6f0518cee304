"""Prompt logprobs over HTTP: completions' echo + logprobs (every prompt token but the first scored, streamed or
whole), echo with max_tokens 0 (the prompt scored, nothing generated), vLLM's prompt_logprobs on completions and
chat, all equal to transformers' log-softmax; and the bad inputs that get a 400 naming their field."""
from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers import hf_model
from tests.server.conftest import MODEL_NAME, start_server
from tests.server.openapi import assert_valid
from tests.server.sse import stream_events

PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True}
TOL = 1e-3


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    proc = start_server(tiny_checkpoint, "--max-logprobs", "5", "--block-size", "4")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tokenizer) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' log-softmax at each position but the last."""
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        logits = hf_model(str(tiny_checkpoint))(torch.tensor([ids])).logits[0, :-1].float()
    return ids, torch.log_softmax(logits, -1)


def post(http: httpx.Client, path: str, body: dict) -> dict:
    response = http.post(path, json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def assert_echo_logprobs(lp: dict, reference, k: int) -> None:
    ids, ref = reference
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(len(ids) - 1):
        row, target = ref[pos], ids[pos + 1]
        assert lp["token_logprobs"][pos + 1] == pytest.approx(row[target].item(), abs=TOL)
        top = lp["top_logprobs"][pos + 1]
        assert sorted(top.values(), reverse=True)[:k] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)


def test_echo_with_logprobs_scores_the_prompt_like_transformers(http, reference) -> None:
    ids, _ = reference
    choice = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 3, "echo": True})["choices"][0]
    assert choice["text"].startswith(PROMPT)
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 2
    assert_echo_logprobs(choice["logprobs"], reference, 3)
    # Streamed: the echo comes first, with the same prompt logprobs; then the generated tokens.
    events = stream_events(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 2, "logprobs": 3,
                                                     "echo": True})
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT
    assert first["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"][:len(ids)]
    streamed = [c["logprobs"]["tokens"] for e in events for c in e["choices"] if c.get("logprobs")]
    assert [t for chunk in streamed for t in chunk] == choice["logprobs"]["tokens"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]


def test_echo_with_max_tokens_zero_scores_without_generating(http, reference) -> None:
    ids, _ = reference
    data = post(http, "/v1/completions", {"prompt": [PROMPT, PROMPT], "max_tokens": 0, "logprobs": 1, "echo": True})
    assert data["usage"] == {"prompt_tokens": 2 * len(ids), "completion_tokens": 0, "total_tokens": 2 * len(ids)}
    for choice in data["choices"]:
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert_echo_logprobs(choice["logprobs"], reference, 1)
    plain = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    assert_valid(plain, "CreateCompletionResponse")


def assert_vllm_prompt_logprobs(entries: list, reference, k: int) -> None:
    ids, ref = reference
    assert entries[0] is None and len(entries) == len(ids)
    for pos, entry in enumerate(entries[1:]):
        row, target = ref[pos], ids[pos + 1]
        assert entry[str(target)]["logprob"] == pytest.approx(row[target].item(), abs=TOL)
        assert entry[str(target)]["rank"] == int((row > row[target]).sum()) + 1
        best = row.topk(k).indices.tolist()
        assert set(best) <= {int(t) for t in entry} <= set(best) | {target}
        assert [entry[str(t)]["rank"] for t in best if t != target] == [i + 1 for i, t in enumerate(best) if t != target]


def test_prompt_logprobs_field_on_completions_and_chat(http, reference) -> None:
    data = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "n": 2})
    assert_valid(data, "CreateCompletionResponse")
    for choice in data["choices"]:
        assert_vllm_prompt_logprobs(choice["prompt_logprobs"], reference, 2)
        assert choice["logprobs"] is None
    assert "prompt_logprobs" not in post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})["choices"][0]

    messages = [{"role": "user", "content": "Hello there"}]
    chat = post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1})
    assert_valid(chat, "CreateChatCompletionResponse")
    rendered = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["tokens"]
    entries = chat["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(rendered) == chat["usage"]["prompt_tokens"]
    assert all(str(tok) in entry for tok, entry in zip(rendered[1:], entries[1:]))


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 6}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 6},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_inputs_name_their_field(http, path: str, body: dict, field: str) -> None:
    response = http.post(path, json={**GREEDY, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"]


def test_negative_max_tokens_with_echo_says_what_is_allowed(http) -> None:
    response = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "max_tokens": -1, "echo": True})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "0 only with echo" in message and "got -1" in message, message
