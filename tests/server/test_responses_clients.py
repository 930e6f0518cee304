"""/v1/responses under the clients people run against it, unmodified, with the default real model
(SmolLM2-135M-Instruct, installed by .ci/install): the OpenAI Agents SDK running an agent with a function tool
to its final output, LangChain's ChatOpenAI(use_responses_api=True) (invoke, stream, a tool call via bind_tools
and its result sent back), and the openai SDK's tool round trip, chained by previous_response_id and as the
whole item list."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest

from engine.default_model import DEFAULT_MODEL, default_model_file
from tests.server.server_proc import ServerProcess

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    assert default_model_file() is not None, "the default model is not installed: run bash .ci/install"
    # tool_choice "auto" (what the Agents SDK sends after a tool ran) needs a parser; SmolLM2 writes hermes calls.
    proc = ServerProcess("--model", DEFAULT_MODEL, "--device", "cpu", "--max-model-len", "1024",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_calls_its_tool_to_a_final_output(server: ServerProcess, streamed: bool) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        model = OpenAIResponsesModel(model=DEFAULT_MODEL, openai_client=client)
        # The model is small: the tool is forced, and its result is the agent's final output.
        agent = Agent(name="weather", instructions="You answer weather questions with the get_weather tool.",
                      model=model, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0))
        if not streamed:
            return (await Runner.run(agent, QUESTION, max_turns=3)).final_output
        result = Runner.run_streamed(agent, QUESTION, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result.final_output

    final = asyncio.run(run())
    assert len(cities) == 1 and final == f"It is sunny in {cities[0]}."
    assert "paris" in cities[0].lower()


def test_langchain_chat_openai_on_the_responses_api(server: ServerProcess) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=DEFAULT_MODEL, base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                     use_responses_api=True, temperature=0, max_tokens=30)
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.text and answer.response_metadata["id"].startswith("resp_")
    assert answer.usage_metadata["input_tokens"] > 0 and answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in llm.stream("What is the capital of France?"))
    assert streamed == answer.text

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather" and "paris" in tool_call["args"]["city"].lower()
    messages = [HumanMessage(QUESTION), call, ToolMessage("sunny", tool_call_id=tool_call["id"])]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert final.text and not final.tool_calls


def test_a_forced_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=DEFAULT_MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=40)
    [call] = first.output
    assert call.type == "function_call" and "paris" in json.loads(call.arguments)["city"].lower()
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}
    chained = client.responses.create(model=DEFAULT_MODEL, previous_response_id=first.id, input=[result],
                                      tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=30)
    whole = client.responses.create(model=DEFAULT_MODEL, input=[{"role": "user", "content": QUESTION},
                                                                call.model_dump(exclude_none=True), result],
                                    tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=30)
    assert chained.output_text and chained.output_text == whole.output_text
    assert chained.usage.input_tokens == whole.usage.input_tokens
    assert [item.type for item in chained.output] == ["message"]
