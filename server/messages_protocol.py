"""Pydantic models of Anthropic's Messages requests (POST /v1/messages and /v1/messages/count_tokens), and the
chat request each one is: the system prompt, content blocks, tools and tool_choice in OpenAI's shapes, so that
the one chat path (chat templates, tool prompts, structured outputs, tool-call parsing) serves both APIs.

Unknown fields are refused (400 naming the field), unlike the OpenAI models: Anthropic's API refuses them too,
and a field such as `thinking` or an image block that this server cannot honour must not be dropped quietly.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from server.protocol import ChatCompletionRequest, ChatMessage, refuse_types
from server.structured_request import FunctionDefinition, FunctionName, NamedToolChoice, Tool

_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")
_BLOCKS_OF = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}
# A failed tool call reaches the model as its text with this in front: chat templates have no error flag.
TOOL_ERROR_PREFIX = "Error: "


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AnthropicTextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    # Prompt caching is automatic here (prefix caching), so a cache breakpoint asks for nothing more;
    # citations are metadata of an earlier answer, not input to the model.
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class AnthropicToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: StrictStr = Field(min_length=1)
    name: StrictStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr = Field(min_length=1)
    content: StrictStr | list[AnthropicTextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _join(self.content or [])
        return TOOL_ERROR_PREFIX + text if self.is_error else text


class AnthropicThinkingBlock(_Strict):
    """An earlier answer's reasoning (with --reasoning-parser), sent back with it. Anthropic leaves the
    thinking of earlier turns out of the prompt; so does this server."""
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


AnthropicBlock = Annotated[AnthropicTextBlock | AnthropicToolUseBlock | AnthropicToolResultBlock
                           | AnthropicThinkingBlock, Field(discriminator="type")]


def _join(blocks: list[AnthropicTextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


class AnthropicMessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[AnthropicBlock], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, content: Any) -> Any:
        return refuse_types(content, _BLOCK_TYPES, "content blocks", f"{', '.join(_BLOCK_TYPES)} blocks")


class AnthropicTool(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError('input_schema must be a JSON schema of "type": "object".')
        return schema


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class AnthropicMetadata(_Strict):
    user_id: StrictStr | None = None


class CountTokensRequest(_Strict):
    """What a prompt is made of: the body of /v1/messages/count_tokens, and part of every /v1/messages body."""
    model: StrictStr
    messages: list[AnthropicMessageParam] = Field(min_length=1)
    system: StrictStr | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"server tools (type {kind!r}) are not supported by this server; send client "
                                 "tools: {name, description, input_schema}.")
        return tools

    def chat_request(self, **fields: Any) -> ChatCompletionRequest:
        """The chat request this is; `fields` are the chat request's sampling fields."""
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise ValueError("thinking is not supported by this server; leave it out or send {\"type\": \"disabled\"}.")
        tools = [Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
                 for t in self.tools] if self.tools is not None else None
        choice, parallel = _tool_choice(self.tool_choice)
        return ChatCompletionRequest(model=self.model, messages=self._chat_messages(), tools=tools,
                                     tool_choice=choice, parallel_tool_calls=parallel, **fields)

    def _chat_messages(self) -> list[ChatMessage]:
        if self.messages[-1].role == "assistant":
            raise ValueError("messages must end with a user message: continuing a final assistant message "
                             "(prefill) is not supported by this server.")
        system = self.system if isinstance(self.system, str) or self.system is None else _join(self.system)
        out = [ChatMessage(role="system", content=system)] if system else []
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            out += _chat_turn(message, called, f"messages[{i}]")
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(json_schema_extra={"minimum": 1})
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})
    top_p: StrictFloat | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: StrictInt | None = Field(None, json_schema_extra={"minimum": 0})
    stream: StrictBool = False
    metadata: AnthropicMetadata | None = None
    # Honoured as they are: one service tier, and prefix caching that needs no breakpoint.
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None

    def to_chat(self) -> ChatCompletionRequest:
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise ValueError(f"temperature must be in [0, 1], got {self.temperature}.")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be at least 0, got {self.top_k}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        return self.chat_request(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                                 top_p=self.top_p, top_k=self.top_k, stream=self.stream,
                                 user=self.metadata.user_id if self.metadata else None)


def _tool_choice(choice: AnthropicToolChoice | None) -> tuple[Any, bool]:
    """Anthropic's tool_choice as OpenAI's (auto, any -> required, tool -> a named function, none) and
    parallel_tool_calls."""
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if (choice.type == "tool") != (choice.name is not None):
        raise ValueError('tool_choice needs a name exactly when its type is "tool".')
    if choice.type == "tool":
        return NamedToolChoice(function=FunctionName(name=choice.name)), parallel
    return {"any": "required"}.get(choice.type, choice.type), parallel


def _chat_turn(message: AnthropicMessageParam, called: set[str], where: str) -> list[ChatMessage]:
    """One Anthropic message as chat messages: tool results become `tool` messages of their own, in order;
    an assistant's tool_use blocks become its tool_calls. `called` collects the tool_use ids seen so far."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if block.type not in _BLOCKS_OF[message.role]:
            raise ValueError(f"{where}.content[{j}]: a {message.role} message may not hold a {block.type} block.")
        if isinstance(block, AnthropicTextBlock):
            texts.append(block.text)
        elif isinstance(block, AnthropicThinkingBlock):
            continue
        elif isinstance(block, AnthropicToolUseBlock):
            called.add(block.id)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            if block.tool_use_id not in called:
                raise ValueError(f"{where}.content[{j}]: tool_result for {block.tool_use_id!r}, which no earlier "
                                 "assistant tool_use block has as its id.")
            if texts:       # text written before a result stays before it
                out.append(ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            out.append(ChatMessage(role="tool", content=block.text(), tool_call_id=block.tool_use_id))
    if message.role == "assistant":
        extra = {"tool_calls": calls} if calls else {}
        return [ChatMessage(role="assistant", content="\n".join(texts), **extra)]
    if texts or not out:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out
