"""POST /v1/embeddings against a real server: the openai SDK and langchain as clients, float and base64,
usage equal to /tokenize's counts, parity with transformers (last and mean pooling, chunked prefill), the KV cache
back at its baseline after a burst mixed with chat, abort on disconnect, 429, bad input, and LLM.embed."""
from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta
from tests.reliability.helpers import FAULTS, fault, fault_async, gauges, wait_for_metrics
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, start_server
from tests.server.fakes import scripted_client
from tests.server.openapi import assert_valid
from tests.server.prom import GUARD_S, is_idle, scrape, wait_until_idle
from tests.server.server_proc import ServerProcess

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a"]
TOL = 1e-5          # against transformers
SAME = 1e-6         # the server against itself in another batch (float32 rounding)


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    proc = start_server(tiny_checkpoint, "--dtype", "float32", env=FAULTS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def mean_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    """Mean pooling, and a step budget of 16 tokens: a long input is prefilled in many chunks."""
    proc = start_server(tiny_checkpoint, "--dtype", "float32", "--pooling-type", "mean",
                        "--max-num-batched-tokens", "16")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def embed(http: httpx.Client, input, **extra) -> dict:
    response = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": input, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def vectors(body: dict) -> list[list[float]]:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [d["embedding"] for d in body["data"]]


def token_ids(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def assert_close(a, b, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=atol, rtol=0)


@torch.inference_mode()
def hf_embedding(checkpoint: Path, ids: list[int], pooling: str) -> list[float]:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1).tolist()


def long_ids(n: int) -> list[int]:
    return [(7 * i) % 1000 + 3 for i in range(n)]


# --------------------------------------------------------------------------------------------- clients
def test_sdk_float_and_base64_agree_and_are_unit_norm(sdk: openai.OpenAI, http: httpx.Client) -> None:
    as_base64 = sdk.embeddings.create(model=MODEL_NAME, input=TEXTS)     # the SDK asks for base64 by default
    as_float = sdk.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert as_base64.object == "list" and as_base64.model == MODEL_NAME
    assert [d.index for d in as_float.data] == [0, 1, 2] and all(d.object == "embedding" for d in as_float.data)
    floats = [d.embedding for d in as_float.data]
    # Equal up to float32 rounding: a later request may be batched differently, or served from the prefix
    # cache (that both formats carry the engine's very bytes is checked in-process below).
    assert_close([d.embedding for d in as_base64.data], floats, SAME)
    assert len({len(v) for v in floats}) == 1
    for v in floats:
        assert abs(np.linalg.norm(v) - 1.0) < 1e-6
    raw = embed(http, TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() for d in raw["data"]]
    assert_close(decoded, floats, SAME)
    body = embed(http, TEXTS)                                             # float is the API's default
    assert_valid(body, "CreateEmbeddingResponse")
    assert_close(vectors(body), floats, SAME)


def test_batch_equals_singles_and_usage_counts_tokens(sdk: openai.OpenAI, http: httpx.Client) -> None:
    counts = [len(token_ids(http, t)) for t in TEXTS]
    batch = sdk.embeddings.create(model=MODEL_NAME, input=TEXTS)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(counts)
    for text, count, in_batch in zip(TEXTS, counts, batch.data):
        single = sdk.embeddings.create(model=MODEL_NAME, input=text, user="someone")
        assert single.usage.prompt_tokens == single.usage.total_tokens == count
        assert_close(single.data[0].embedding, in_batch.embedding, SAME)


def test_token_id_inputs(http: httpx.Client) -> None:
    ids = [token_ids(http, t) for t in TEXTS]
    by_text = vectors(embed(http, TEXTS))
    assert_close(vectors(embed(http, ids)), by_text, SAME)
    single = embed(http, ids[1])
    assert single["usage"]["prompt_tokens"] == len(ids[1])
    assert_close(vectors(single)[0], by_text[1], SAME)


def test_langchain_openai_embeddings(server: ServerProcess, http: httpx.Client) -> None:
    from langchain_openai import OpenAIEmbeddings
    lc = OpenAIEmbeddings(base_url=server.base_url + "/v1", api_key="unused", model=MODEL_NAME,
                          check_embedding_ctx_length=False)
    expected = vectors(embed(http, TEXTS))
    assert_close(lc.embed_documents(TEXTS), expected, SAME)
    assert_close(lc.embed_query(TEXTS[0]), expected[0], SAME)


def test_offline_llm_embed_returns_the_endpoints_vectors(tiny_checkpoint: Path, http: httpx.Client) -> None:
    from engine import LLM
    llm = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    offline = [o.outputs.embedding for o in llm.embed(TEXTS)]
    assert_close(offline, vectors(embed(http, TEXTS)), SAME)
    ids = [token_ids(http, t) for t in TEXTS]
    assert_close([o.outputs.embedding for o in llm.embed(ids)], offline, SAME)


# --------------------------------------------------------------------------------------------- parity
def test_last_pooling_matches_transformers(tiny_checkpoint: Path, http: httpx.Client) -> None:
    inputs = [token_ids(http, TEXTS[1]), long_ids(200), [5]]
    for ids, got in zip(inputs, vectors(embed(http, inputs))):
        assert_close(got, hf_embedding(tiny_checkpoint, ids, "last"), TOL)


def test_mean_pooling_over_chunked_prefill_matches_transformers(tiny_checkpoint: Path, mean_server) -> None:
    inputs = [long_ids(MAX_MODEL_LEN), long_ids(37), [5]]       # 256 tokens: 16 chunks of 16
    with httpx.Client(base_url=mean_server.base_url, timeout=GUARD_S) as client:
        batch = vectors(embed(client, inputs))
        for ids, got in zip(inputs, batch):
            assert_close(got, hf_embedding(tiny_checkpoint, ids, "mean"), TOL)
        assert_close(vectors(embed(client, inputs[0]))[0], batch[0], SAME)       # alone, and again
        assert is_idle(wait_until_idle(client, 0.0), 0.0)


# --------------------------------------------------------------------------------------------- the engine
def test_burst_with_chat_leaves_the_kv_cache_at_baseline(http: httpx.Client) -> None:
    baseline = wait_until_idle(http, scrape(http)["pagedserve_kv_cache_usage_perc"])
    kv = baseline["pagedserve_kv_cache_usage_perc"]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "ignore_eos": True}

    def embedding(i: int) -> httpx.Response:
        inputs = [long_ids(20 + i), long_ids(3 + i)] if i % 2 else [f"text {i}", f"more text {i}"]
        return http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": inputs})

    with ThreadPoolExecutor(16) as pool:
        embeddings = [pool.submit(embedding, i) for i in range(24)]
        chats = [pool.submit(http.post, "/v1/chat/completions", json=chat) for _ in range(8)]
        embeddings, chats = [f.result() for f in embeddings], [f.result() for f in chats]
    assert [r.status_code for r in embeddings + chats] == [200] * 32
    assert all(len(r.json()["data"]) == 2 for r in embeddings)
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in chats)
    after = wait_until_idle(http, kv)
    assert is_idle(after, kv), "embedding requests kept KV blocks"
    grew = after["pagedserve_request_success_total{stop}"] - baseline["pagedserve_request_success_total{stop}"]
    assert grew == 48           # every embedding input finished with "stop" (the chats with "length")


async def _disconnect_while_held(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S) as client:
        await fault_async(client, "hold")          # no step runs: the request can only leave by its abort
        task = asyncio.ensure_future(client.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "hi"}))
        await wait_for_metrics(client, lambda m: gauges(m) == (0, 1), "1 waiting")
        task.cancel()                              # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task


def test_a_client_that_leaves_aborts_its_request(server: ServerProcess, http: httpx.Client) -> None:
    before = wait_until_idle(http, 0.0)
    try:
        asyncio.run(_disconnect_while_held(server.base_url))
        after = wait_until_idle(http, 0.0)
    finally:
        fault(http, "release")
    assert is_idle(after, 0.0)
    assert after["pagedserve_request_success_total{abort}"] - before["pagedserve_request_success_total{abort}"] == 1
    assert http.get("/health").status_code == 200


def test_a_full_queue_answers_429_and_the_vector_is_rendered() -> None:
    """In-process, with the test playing the engine: a second request beyond --max-queue-len is refused with
    429; the first gets the vector the engine sends, as floats."""
    vector = np.array([0.6, -0.8, 0.0], dtype="<f4")
    for client, [engine] in scripted_client(max_queue_len=1):
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault(
            "first", client.post("/v1/embeddings", json={"input": [5, 6, 7]})))
        thread.start()
        request_id, prompt, params, arrival = engine.added.get(timeout=GUARD_S)
        assert params.embed and params.max_tokens == 0 and prompt == [5, 6, 7]
        refused = client.post("/v1/embeddings", json={"input": "hi"})
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert_valid(refused.json(), "ErrorResponse")
        engine.deliver([RequestDelta(request_id, [SequenceDelta(0, [], None, "stop")], True, 3, 0,
                                     RequestTimings(arrival), embedding=vector.tobytes())], EngineStats())
        thread.join(GUARD_S)
        first = result["first"]
        assert first.status_code == 200, first.text
        assert first.json()["data"] == [{"object": "embedding", "index": 0, "embedding": vector.tolist()}]
        assert first.json()["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def test_both_encodings_carry_the_engines_float32_values_exactly() -> None:
    """In-process, with the test playing the engine: the SDK decodes the same values from float and base64."""
    vector = np.array([0.1, -0.7, 1e-8, 0.7], dtype="<f4")
    for client, [engine] in scripted_client():
        sdk = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client,
                            max_retries=0)
        calls = {  # the SDK asks for base64 itself when no encoding_format is given, and decodes it
            "float": lambda: sdk.embeddings.create(model="scripted", input="hi", encoding_format="float"
                                                   ).data[0].embedding,
            "sdk's base64": lambda: sdk.embeddings.create(model="scripted", input="hi").data[0].embedding,
            "base64": lambda: list(np.frombuffer(base64.b64decode(client.post("/v1/embeddings", json={
                "input": "hi", "encoding_format": "base64"}).json()["data"][0]["embedding"]), dtype="<f4").tolist()),
        }
        for name, call in calls.items():
            result = {}
            thread = threading.Thread(target=lambda: result.setdefault("embedding", call()))
            thread.start()
            request_id, prompt, _, arrival = engine.added.get(timeout=GUARD_S)
            engine.deliver([RequestDelta(request_id, [SequenceDelta(0, [], None, "stop")], True, len(prompt), 0,
                                         RequestTimings(arrival), embedding=vector.tobytes())], EngineStats())
            thread.join(GUARD_S)
            assert result["embedding"] == vector.tolist(), name


# --------------------------------------------------------------------------------------------- bad input
BAD = [
    ({"model": MODEL_NAME}, 400, "input"),
    ({"input": ""}, 400, "empty"),
    ({"input": []}, 400, "empty"),
    ({"input": ["a", ""]}, 400, "empty"),
    ({"input": [[]]}, 400, "empty"),
    ({"input": 5}, 400, "input"),
    ({"input": [1.5]}, 400, "input"),
    ({"input": {"text": "a"}}, 400, "input"),
    ({"input": ["a", 1]}, 400, "input"),
    ({"input": [[1, 2], "a"]}, 400, "input"),
    ({"input": "a", "dimensions": 8}, 400, "dimensions"),
    ({"input": "a", "dimensions": "8"}, 400, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "a", "encoding_format": None}, 400, "encoding_format"),
    ({"input": long_ids(MAX_MODEL_LEN + 1)}, 400, "maximum context length"),
    ({"input": [long_ids(5), long_ids(MAX_MODEL_LEN + 1)]}, 400, "maximum context length"),
    ({"input": "word " * 5000}, 400, "maximum context length"),
    ({"input": [10**9]}, 400, "token ids"),
    ({"input": [-1]}, 400, "token ids"),
    ({"input": ["a"] * 257}, 400, "at most 256"),
    ({"input": "a", "model": "no-such-model"}, 404, "does not exist"),
]


@pytest.mark.parametrize("body, status, says", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_refused_in_the_error_envelope(http: httpx.Client, body: dict, status: int, says: str) -> None:
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    assert_valid(response.json(), "ErrorResponse")
    assert says in response.json()["error"]["message"]


def test_the_server_stays_healthy_after_bad_input(http: httpx.Client) -> None:
    assert http.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"}
                     ).status_code == 400
    assert http.post("/v1/embeddings", content=json.dumps({"input": "a"}),
                     headers={"content-type": "text/plain"}).status_code == 400
    for body, _, _ in BAD:
        assert http.post("/v1/embeddings", json=body).status_code < 500
    assert http.get("/health").status_code == 200
    assert len(vectors(embed(http, "still fine"))) == 1


def test_the_route_is_documented(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    operation = doc["paths"]["/v1/embeddings"]["post"]
    schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/EmbeddingResponse"}
    assert {"400", "404", "429", "503"} <= set(operation["responses"]) and "422" not in operation["responses"]
    assert set(doc["components"]["schemas"]["EmbeddingResponse"]["required"]) == {"object", "data", "model", "usage"}
