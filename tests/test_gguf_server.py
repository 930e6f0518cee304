"""`pagedserve serve` with no --model serves the real default model (SmolLM2-135M-Instruct) and answers
through the OpenAI SDK."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.server_proc import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_file) -> Iterator[ServerProcess]:
    proc = ServerProcess("--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "4").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_default_model_is_served_under_its_name(server, client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    assert "not installed" not in server.log_tail(100_000)


def test_capital_of_france_is_paris(client):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0,
                                           max_completion_tokens=48)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"


def test_streamed_text_equals_non_streamed_text(client):
    kwargs = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 40}
    messages = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
    whole = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(messages=messages, stream=True, **kwargs) if c.choices]
    assert len(pieces) > 5 and "".join(pieces) == whole
    prompt = "The three most important inventions of the last century are"
    text = client.completions.create(prompt=prompt, **kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kwargs)
                       if c.choices)
    assert len(text) > 20 and streamed == text
