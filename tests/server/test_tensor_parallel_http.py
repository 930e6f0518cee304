"""`pagedserve serve --model tiny-random --tensor-parallel-size 2` (two gloo ranks on CPU) passes the
completions and chat tests of tests/server (imported below, run against this server), and its greedy text
equals the single-process engine's."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.default_model import resolve
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME
from tests.server.server_proc import ServerProcess
from tests.server.test_chat import (  # noqa: F401  (collected here against the tensor-parallel server)
    prompt_len,
    test_chat_non_stream_and_stream_agree,
    test_n_and_multi_turn,
    test_openai_sdk_chat_stream,
)
from tests.server.test_completions import (  # noqa: F401
    test_batch_prompts_n_and_token_prompts,
    test_greedy_usage_and_stream_equals_non_stream,
    test_logprobs,
    test_openai_sdk,
    test_service_endpoints,
    test_stop_strings,
    tokenizer,
)


@pytest.fixture(scope="module")
def tiny_checkpoint() -> Path:
    """The built-in tiny-random checkpoint: the imported tests' tokenizer comes from it."""
    return Path(resolve("tiny-random").path)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", "tiny-random", "--served-model-name", MODEL_NAME, "--device", "cpu",
                         "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
                         "--tensor-parallel-size", "2").wait_ready()
    yield proc
    proc.stop()


def test_tensor_parallel_greedy_text_equals_one_rank(http: httpx.Client) -> None:
    prompts = ["The quick brown fox", "Once upon a time, in a land far away,"]
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    served = [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
    llm = LLM(model="tiny-random", device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    ref = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert served == [o.outputs[0].text for o in ref]
