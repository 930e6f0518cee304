"""The Responses API's answers as the OpenAPI document shows them (/openapi.json): the Response object, its
output items and usage, the deleted and input-items bodies, and its stream's typed events. Like
server/api_schema.py's models they document bodies the routes build as dicts (server/responses_output.py).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ResponseOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseOutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: ItemStatus
    content: list[ResponseOutputText]


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str                   # JSON text
    status: ItemStatus


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ResponseReasoning(BaseModel):
    """With --reasoning-parser: the reasoning the model wrote before its answer."""
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ResponseReasoningText]
    status: ItemStatus


class ResponseInputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class ResponseOutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class ResponseIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponseObject(BaseModel):
    """POST /v1/responses' answer (OpenAI's Response), also what GET /v1/responses/{id} returns."""
    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: ResponseErrorInfo | None
    incomplete_details: ResponseIncompleteDetails | None
    instructions: str | None
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionCall | ResponseReasoning]
    parallel_tool_calls: bool
    previous_response_id: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any]
    text: dict[str, Any]
    reasoning: None
    truncation: Literal["disabled"]
    store: bool
    background: bool
    service_tier: Literal["default"]
    user: str | None = None                 # these four: left out when unset
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    usage: ResponseUsage | None = None      # left out until the response is done


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseItemList(BaseModel):
    """GET /v1/responses/{id}/input_items: a page of the input items (messages, function calls and outputs)."""
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# The Responses API's stream: typed events with a sequence_number, response.created ... response.completed.
RESPONSES_SSE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "response.created, response.in_progress, response.output_item.added, "
                                                "response.content_part.added, response.output_text.delta, ..., "
                                                "then response.completed, response.incomplete or response.failed."},
    "data": {"type": "string", "description": "The event's JSON object; its `type` is the event's name."}}}
