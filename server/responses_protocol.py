"""Pydantic models of OpenAI's Responses requests (POST /v1/responses), and the chat request each one is:
instructions, input items (messages, function calls and their outputs), tools, tool_choice and text.format in
chat's shapes, so that the one chat path (chat templates, tool prompts, structured outputs, tool-call parsing)
serves this API too.

Unknown fields are refused (400 naming the field), unlike the chat models: a field such as `background` or a
built-in tool that this server cannot honour must not be dropped quietly. The fields the SDKs send that ask
for nothing this server would do otherwise (include, truncation "disabled", prompt_cache_key, ...) are
accepted by name.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from server.protocol import ChatCompletionRequest, ChatMessage, refuse_types
from server.structured_request import (
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)

_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_PART_TYPES = ("input_text", "output_text", "refusal")
MAX_METADATA_KEYS = 16
# Fields of OpenAI's API this server cannot honour, and what to do instead (any other unknown field is refused
# by name too).
_UNSUPPORTED_FIELDS = {
    "conversation": "conversations are not supported by this server; chain responses with previous_response_id, "
                    "or send the whole conversation as input",
    "prompt": "prompt templates are not supported by this server; send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported by this server; leave it out",
    "context_management": "context_management is not supported by this server; leave it out",
}
# Fields accepted only with the value that asks for nothing this server does not do (compared with `is`/type:
# 0 is not False here).
_ONLY = {
    "background": ((None, False), "background responses are not supported by this server; leave background out or "
                                  "send false"),
    "truncation": ((None, "disabled"), 'truncation "auto" is not supported by this server (an input too long for '
                                       'the context is a 400); leave truncation out or send "disabled"'),
    "top_logprobs": ((None, 0), "top_logprobs is not supported by this server's Responses API; use "
                                "/v1/chat/completions with logprobs"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """input_text (what a user wrote), output_text (an earlier answer sent back) or refusal."""
    type: Literal["input_text", "output_text", "refusal"]
    text: StrictStr | None = None
    refusal: StrictStr | None = None
    # output_text parts of an earlier answer carry these; they are metadata, not input to the model.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def content(self) -> str:
        value = self.refusal if self.type == "refusal" else self.text
        if value is None:
            raise ValueError(f"a content part of type {self.type!r} needs its "
                             f"{'refusal' if self.type == 'refusal' else 'text'}.")
        return value


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[TextPart]
    # An earlier output sent back has an id and a status (and newer SDKs' `phase`).
    id: StrictStr | None = None
    status: StrictStr | None = None
    phase: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _supported_parts(cls, content: Any) -> Any:
        return refuse_types(content, _PART_TYPES, "content parts", f"{', '.join(_PART_TYPES)} parts")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.content() for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None
    # Newer SDKs' fields of an output call sent back; this server never sets them (no namespaced tools).
    namespace: None = None
    caller: None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: StrictStr | list[TextPart]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.content() for p in self.output)


class ReasoningItem(_Strict):
    """An earlier answer's reasoning (with --reasoning-parser), sent back with it. Like the reasoning of
    earlier turns in chat templates, it stays out of the prompt."""
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None      # the only one a model without that training has


class StreamOptions(_Strict):
    include_obfuscation: StrictBool | None = None   # no obfuscation here: its padding asks for nothing


class ReasoningConfig(_Strict):
    effort: None = None
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(_Strict):
    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: StrictFloat | StrictInt | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 2})
    top_p: StrictFloat | StrictInt | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(None, json_schema_extra={"maxProperties": MAX_METADATA_KEYS})
    user: StrictStr | None = None
    # Accepted as the SDKs send them, asking for nothing this server does otherwise: prefix caching needs
    # no key, one service tier, no truncation (a conversation too long for the context is a 400).
    # Reasoning is never encrypted here: a reasoning item carries its text, and encrypted_content is null.
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: StrictStr | None = None
    service_tier: Literal["auto", "default"] | None = None
    top_logprobs: StrictInt | None = Field(None, json_schema_extra={"enum": [0, None]})
    background: StrictBool | None = Field(None, json_schema_extra={"enum": [False, None]})

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, body: Any) -> Any:
        for name, why in _UNSUPPORTED_FIELDS.items():
            if isinstance(body, dict) and body.get(name) is not None:
                raise ValueError(f"{why}.")
        return body

    @field_validator("background", "truncation", "top_logprobs", mode="before")
    @classmethod
    def _only_what_is_done(cls, value: Any, info: Any) -> Any:
        allowed, why = _ONLY[info.field_name]
        kinds = {type(a) for a in allowed if a is not None}
        if type(value) in kinds and not any(type(value) is type(a) and value == a for a in allowed):
            raise ValueError(f"{why}.")
        return value

    @field_validator("include", mode="before")
    @classmethod
    def _includable(cls, include: Any) -> Any:
        for value in include if isinstance(include, list) else ():
            if isinstance(value, str) and value != "reasoning.encrypted_content":
                raise ValueError(f"include {value!r} is not supported by this server (reasoning.encrypted_content "
                                 "is accepted: reasoning items carry their text, never encrypted).")
        return include

    @field_validator("reasoning", mode="before")
    @classmethod
    def _no_reasoning_options(cls, reasoning: Any) -> Any:
        if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
            raise ValueError("reasoning options (effort, summary) are not supported by this server: a model "
                             "reasons as it was trained (see --reasoning-parser); leave reasoning out.")
        return reasoning

    @field_validator("input", mode="before")
    @classmethod
    def _supported_items(cls, items: Any) -> Any:
        """Messages may leave out their type (EasyInputMessage); other item types are named in the 400."""
        if not isinstance(items, list):
            return items
        out = []
        for item in items:
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in _ITEM_TYPES:
                raise ValueError(f"input items of type {kind!r} are not supported by this server; send "
                                 f"{', '.join(_ITEM_TYPES)} items.")
            out.append(item)
        return out

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        return refuse_types(tools, ("function",), "tools", 'function tools (built-in tools are not): {type: '
                            '"function", name, parameters}')

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tool_choice of type {kind!r} is not supported by this server; send \"auto\", "
                             "\"none\", \"required\" or {type: \"function\", name}.")
        return choice

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        """The input as items (a string is one user message)."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def to_chat(self, history: list[Any] = ()) -> ChatCompletionRequest:
        """The chat request this is; `history` are the items of the previous response's conversation
        (previous_response_id), in front of this request's input. Its instructions are not carried over."""
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}.")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata may hold at most {MAX_METADATA_KEYS} keys, got {len(self.metadata)}.")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options may only be set when stream is true.")
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        messages += chat_messages([*history, *self.items()])
        if not any(m.role in ("user", "tool") for m in messages):
            raise ValueError("input must hold at least one user message or function_call_output item.")
        tools = [Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters,
                                                  strict=t.strict)) for t in self.tools] if self.tools else None
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(function=FunctionName(name=choice.name))
        elif not tools and choice in ("auto", "none"):
            choice = None                   # what the SDKs send with no tools asks for nothing
        return ChatCompletionRequest(
            model=self.model, messages=messages, tools=tools, tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls is not False, max_tokens=self.max_output_tokens,
            temperature=None if self.temperature is None else float(self.temperature),
            top_p=None if self.top_p is None else float(self.top_p), stream=self.stream, user=self.user,
            response_format=self._response_format())

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.name is None or fmt.schema_ is None:
            raise ValueError('text.format of type "json_schema" needs a name and a schema.')
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def chat_messages(items: list[Any]) -> list[ChatMessage]:
    """Items as chat messages: function_call items join the assistant message before them (or make one) as
    its tool_calls; each function_call_output is a `tool` message answering a call made earlier."""
    out: list[ChatMessage] = []
    called: set[str] = set()
    calls_of: ChatMessage | None = None        # the assistant message the next function_call joins
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=item.text()))
            calls_of = out[-1] if item.role == "assistant" else None
        elif isinstance(item, FunctionCallItem):
            if calls_of is None:
                out.append(ChatMessage(role="assistant", content=""))
                calls_of = out[-1]
            called.add(item.call_id)
            calls = getattr(calls_of, "tool_calls", None) or []
            calls_of.tool_calls = [*calls, {"id": item.call_id, "type": "function",
                                            "function": {"name": item.name, "arguments": item.arguments}}]
        else:
            if item.call_id not in called:
                raise ValueError(f"input[{i}]: function_call_output for call_id {item.call_id!r}, which no "
                                 "earlier function_call item has.")
            out.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
            calls_of = None
    return out
