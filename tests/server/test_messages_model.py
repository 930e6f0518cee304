"""A real model behind /v1/messages: SmolLM2-135M-Instruct (the default model, installed by .ci/install) with the
unmodified anthropic SDK: a natural end of turn, streamed and not, and a forced tool call answered in a
follow-up that carries the assistant's tool_use block and the user's tool_result."""
from __future__ import annotations

from collections.abc import Iterator

import anthropic
import jsonschema
import pytest

from engine.default_model import DEFAULT_MODEL, default_model_file
from tests.server.server_proc import ServerProcess

GREEDY = {"temperature": 0}      # the SDK has no sampling arguments; the API takes them in the body
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client() -> Iterator[anthropic.Anthropic]:
    assert default_model_file() is not None, "the default model is not installed: run bash .ci/install"
    server = ServerProcess("--device", "cpu", "--max-model-len", "1024", "--enable-auto-tool-choice").wait_ready()
    try:
        yield anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    finally:
        server.stop()


def test_end_turn_streamed_and_not(client: anthropic.Anthropic) -> None:
    ask = dict(model=DEFAULT_MODEL, max_tokens=200, system="Answer in one short sentence.",
               messages=[{"role": "user", "content": "What is the capital of France?"}], extra_body=GREEDY)
    message = client.messages.create(**ask)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and "Paris" in block.text
    assert 0 < message.usage.output_tokens < 200
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text and final.content[0].text == block.text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == message.usage.output_tokens


def test_forced_tool_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = client.messages.create(model=DEFAULT_MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow = [*ask, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                            "content": [{"type": "text", "text": "Sunny and 21 degrees."}]}]}]
    # tool_choice auto (the default): the server lists the tools and writes the earlier call into the prompt;
    # whatever the model does next is read by the hermes parser, and the stop reason says which it was.
    answer = client.messages.create(model=DEFAULT_MODEL, max_tokens=120, messages=follow, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert answer.content and answer.usage.output_tokens > 0
    calls = [b for b in answer.content if b.type == "tool_use"]
    assert answer.stop_reason == ("tool_use" if calls else "end_turn")
    for again in calls:
        assert again.name == "get_weather" and again.id != call.id
    counted = client.messages.count_tokens(model=DEFAULT_MODEL, messages=follow, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens
    # tool_choice none: a text answer that ends its turn.
    final = client.messages.create(model=DEFAULT_MODEL, max_tokens=120, messages=follow, tools=[WEATHER],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert final.stop_reason == "end_turn"
    [reply] = final.content
    assert reply.type == "text" and reply.text.strip()
