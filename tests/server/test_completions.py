"""/v1/completions against the real server (tiny random checkpoint, CPU), plus the service endpoints."""
from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, pick_stop
from tests.server.openapi import assert_valid
from tests.server.sse import stream_events, texts_by_index

PROMPT = "The quick brown fox"
GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


def complete(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    assert_valid(data, "CreateCompletionResponse")
    return data


def test_service_endpoints(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert_valid(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN and models["data"][0]["owned_by"]
    assert http.get(f"/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    assert http.get("/v1/models/other").status_code == 404
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_greedy_usage_and_stream_equals_non_stream(http: httpx.Client, tokenizer) -> None:
    data = complete(http, prompt=PROMPT, max_tokens=7)
    [choice] = data["choices"]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert data["id"].startswith("cmpl-") and data["model"] == MODEL_NAME
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    assert data["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 7, "total_tokens": prompt_tokens + 7}

    events = stream_events(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 7})
    for event in events:
        assert_valid(event, "CompletionStreamChunk")
        assert len(event["choices"]) == 1 and "usage" not in event
        assert event["id"] == events[0]["id"] and event["created"] == events[0]["created"]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] and events[-1]["choices"][0]["finish_reason"] == "length"
    assert texts_by_index(events) == {0: choice["text"]}


def test_batch_prompts_n_and_token_prompts(http: httpx.Client, tokenizer) -> None:
    prompts = [PROMPT, "Once upon a time"]
    data = complete(http, prompt=prompts, n=2, max_tokens=5)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in data["choices"]]
    # Greedy: the n samples of a prompt agree; the choices are prompt-major.
    assert texts[0] == texts[1] and texts[2] == texts[3]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert data["usage"]["prompt_tokens"] == sum(map(len, ids)) and data["usage"]["completion_tokens"] == 20
    # The same prompts as token ids give the same text; a single id list is one prompt.
    assert [c["text"] for c in complete(http, prompt=ids, max_tokens=5)["choices"]] == [texts[0], texts[2]]
    assert complete(http, prompt=ids[1], max_tokens=5)["choices"][0]["text"] == texts[2]

    events = stream_events(http, "/v1/completions", {**GREEDY, "prompt": prompts, "n": 2, "max_tokens": 5})
    assert texts_by_index(events) == dict(enumerate(texts))
    finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]


def test_echo(http: httpx.Client) -> None:
    plain = complete(http, prompt=PROMPT, max_tokens=4)["choices"][0]["text"]
    echoed = complete(http, prompt=PROMPT, max_tokens=4, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + plain
    events = stream_events(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 4, "echo": True})
    assert texts_by_index(events) == {0: PROMPT + plain}


def check_offsets(text: str, lp: dict, special: set[str]) -> None:
    """Each token sits in the text at its text_offset (tokens of partial characters excepted)."""
    for tok, offset in zip(lp["tokens"], lp["text_offset"]):
        if not tok.startswith("bytes:") and tok not in special:
            assert text[offset:offset + len(tok)] == tok, (tok, offset, text)
    assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs(http: httpx.Client, tokenizer, k: int) -> None:
    data = complete(http, prompt=PROMPT, max_tokens=6, logprobs=k)
    choice = data["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert lp["text_offset"][0] == 0
    check_offsets(choice["text"], lp, set(tokenizer.all_special_tokens))
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert max(k, 1) <= len(top) <= k + 1
        assert chosen <= 0.0 and top[tok] == chosen
        if k:   # greedy picks the most likely token
            assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert complete(http, prompt=PROMPT, max_tokens=2)["choices"][0]["logprobs"] is None

    events = stream_events(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 6, "logprobs": k})
    streamed = [c["logprobs"] for e in events for c in e["choices"] if c["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]


def test_echo_with_logprobs_scores_prompt_tokens(http: httpx.Client, tokenizer) -> None:
    # Not schema-checked: the first echoed token has null logprobs (nothing before it scores it), as in
    # OpenAI's and vLLM's answers, which the spec's `token_logprobs: number[]` does not allow for.
    response = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "max_tokens": 3, "logprobs": 1,
                                                   "echo": True})
    choice = response.json()["choices"][0]
    lp = choice["logprobs"]
    num_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert len(lp["tokens"]) == num_prompt + 3 and choice["text"].startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0.0 for v in lp["token_logprobs"][1:])
    for tok, chosen, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[tok] == chosen and 1 <= len(top) <= 2
    check_offsets(choice["text"], lp, set(tokenizer.all_special_tokens))


def test_stop_strings(http: httpx.Client) -> None:
    full = complete(http, prompt=PROMPT, max_tokens=24, logprobs=1)["choices"][0]
    text = full["text"]
    stop = pick_stop(text)
    expected = text[:text.index(stop)]
    body = {"prompt": PROMPT, "max_tokens": 24, "stop": [stop, "\x00never"]}
    data = complete(http, **body)
    choice = data["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)
    # Usage counts the tokens up to and including the one that completed the stop string.
    stop_end = len(expected) + len(stop)
    assert data["usage"]["completion_tokens"] == sum(o < stop_end for o in full["logprobs"]["text_offset"])

    events = stream_events(http, "/v1/completions", {**GREEDY, **body})
    so_far = ""
    for piece in (c["text"] for e in events for c in e["choices"]):
        so_far += piece
        assert expected.startswith(so_far), "streamed text went past the stop string"
    assert so_far == expected and events[-1]["choices"][0]["finish_reason"] == "stop"

    kept = complete(http, prompt=PROMPT, max_tokens=24, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == expected + stop


def test_include_usage_chunk(http: httpx.Client) -> None:
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 5, "n": 2, "stream_options": {"include_usage": True}}
    events = stream_events(http, "/v1/completions", body)
    *chunks, last = events
    assert last["choices"] == [] and all("usage" not in e for e in chunks)
    assert last["usage"]["completion_tokens"] == 10
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 10


def test_streamed_text_is_whole_utf8(http: httpx.Client) -> None:
    """Sampled output of a byte-level BPE model, multi-byte characters included: the streamed pieces join
    to exactly the whole text (a character split across pieces would show as U+FFFD there instead)."""
    seen = ""
    for seed in range(4):
        body = {"model": MODEL_NAME, "prompt": "Grüße, 東京 😀", "max_tokens": 24, "temperature": 1.5,
                "seed": seed, "ignore_eos": True}
        whole = complete(http, **body)["choices"][0]["text"]
        pieces = [c["text"] for e in stream_events(http, "/v1/completions", body) for c in e["choices"]]
        assert "".join(pieces) == whole
        seen += whole
    assert any(ord(c) > 127 and c != "\ufffd" for c in seen), "no multi-byte character was generated"


def test_openai_sdk(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    [model] = client.models.list().data
    completion = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=5, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    stream = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=5, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == completion.choices[0].text


def test_tokenize_detokenize(http: httpx.Client, tokenizer) -> None:
    body = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer(PROMPT)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN and len(body["token_strs"]) == body["count"]
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
