"""The OpenAPI document (/openapi.json) as the server really behaves: what each route answers, with which
status codes, in which shape. Schema fuzzers (schemathesis) and generated clients take it at its word.

Routes build their bodies as dicts for speed; the models below document those bodies (FastAPI does not
re-validate a Response a route returns). FastAPI's default 422 entries are replaced by what the error
handlers really send: 400 and the OpenAI error envelope.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.errors import is_anthropic_path
from server.security import PUBLIC_PATHS

FinishReason = Literal["stop", "length", "abort"]
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The error shape of the /v1/messages routes."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: null for the first prompt token, then {token id: ...} per token
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None   # only when the request asked for prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str                   # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None           # only when the model called a tool
    reasoning_content: str | None = None                  # with --reasoning-parser
    reasoning: str | None = None                          # the same, under its newer name


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None   # only when the request asked for prompt_logprobs


class AnthropicTextOut(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicThinkingOut(BaseModel):
    """With --reasoning-parser: the reasoning the model wrote before its answer."""
    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(BaseModel):
    """POST /v1/messages' answer (Anthropic's Message)."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[AnthropicTextOut | AnthropicThinkingOut | AnthropicToolUseOut]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    # encoding_format "float": the values; "base64": their little-endian float32 bytes, base64-encoded
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None       # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """vLLM's GET /tokenizer_info: what a client needs to tokenize as the server does (lm-eval's remote
    tokenizer reads it, then sends text to /tokenize and /detokenize)."""
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int              # the server's --max-model-len
    vocab_size: int
    add_bos_token: bool | None = None
    added_tokens: dict[str, str]       # special and added token ids -> their text


class VersionResponse(BaseModel):
    version: str


_WHY = {
    400: "Invalid request (wrong type, value out of range, context too long, malformed JSON).",
    404: "Unknown model (on /v1/responses/{id}: no such stored response).",
    413: "The body is larger than --max-body-bytes.",
    429: "The waiting queue is full (--max-queue-len); retry after the Retry-After header's seconds.",
    500: "Generation failed inside the engine.",
    503: "The engine is not running: the server is shutting down, or its engine stopped.",
    504: "The request ran longer than --request-timeout.",
}


def errors(*codes: int, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for error statuses, all in the OpenAI error envelope (or Anthropic's)."""
    model = AnthropicErrorResponse if anthropic else ErrorResponse
    out: dict[int | str, dict[str, Any]] = {code: {"model": model, "description": _WHY[code]} for code in codes}
    if 429 in codes:
        out[429]["headers"] = {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}}
    return out


# One server-sent event (OpenAPI 3.1 has a text/event-stream `schema` describe each event, not the stream).
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A JSON chunk, an in-band error {\"error\": {...}}, or [DONE] (the last event)."}}}


# Anthropic's stream: named events, message_start ... message_stop, no [DONE].
NAMED_SSE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "message_start, content_block_start, content_block_delta, "
                                                "content_block_stop, message_delta, message_stop, or error."},
    "data": {"type": "string", "description": "The event's JSON object; its `type` is the event's name."}}}


def generation_responses(model: type[BaseModel], anthropic: bool = False,
                         events: dict[str, Any] | None = None) -> dict[int | str, dict[str, Any]]:
    """A JSON body, or with stream=true server-sent events: `data: {chunk}` lines, then `data: [DONE]`
    (Anthropic's routes: named events; `events` describes another stream's events)."""
    events = events or (NAMED_SSE_EVENT if anthropic else SSE_EVENT)
    return {200: {"model": model, "content": {"text/event-stream": {"schema": events}}},
            **errors(400, 404, 413, 429, 500, 503, 504, anthropic=anthropic)}


def install_openapi(app: FastAPI, api_key_required: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, api_key_required)
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI, api_key_required: bool) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if api_key_required:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    for path, operations in schema.get("paths", {}).items():
        # Every app has routes that use each envelope (the Anthropic one: /v1/messages).
        error_ref = {"$ref": "#/components/schemas/" + ("AnthropicErrorResponse" if is_anthropic_path(path)
                                                         else "ErrorResponse")}
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            if api_key_required and path not in PUBLIC_PATHS:
                operation["security"] = [{"bearer": []}, {"apiKey": []}]
                responses["401"] = {"description": "Missing or wrong API key.",
                                    "content": {"application/json": {"schema": error_ref}}}
    return schema
