"""A real model under a JSON schema: SmolLM2-135M-Instruct (the default model, installed by .ci/install)
answers the OpenAI SDK's parse() with an object of the requested type, and calls a required tool."""
from __future__ import annotations

import json

import openai
from pydantic import BaseModel

from engine.default_model import DEFAULT_MODEL, default_model_file
from tests.server.server_proc import ServerProcess


class City(BaseModel):
    name: str
    country: str
    is_capital: bool


def test_smollm2_json_schema_and_tool_call_through_the_sdk() -> None:
    assert default_model_file() is not None, "the default model is not installed: run bash .ci/install"
    server = ServerProcess("--model", DEFAULT_MODEL, "--device", "cpu", "--max-model-len", "512").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Describe Paris as JSON."}]
        completion = client.chat.completions.parse(model=DEFAULT_MODEL, messages=messages, response_format=City,
                                                   max_completion_tokens=60, temperature=0)
        city = completion.choices[0].message.parsed
        assert isinstance(city, City) and city.name == "Paris"
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=tools, tool_choice="required", max_completion_tokens=40, temperature=0)
        [call] = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        assert reply.choices[0].finish_reason == "tool_calls"
    finally:
        server.stop()
