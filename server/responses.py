"""POST /v1/responses and the stored-response routes: OpenAI's Responses API over the chat path.

A Responses request becomes the chat request it means (server/responses_protocol.py) and runs exactly as
/v1/chat/completions runs one (server/chat.py: template, tools, constraint, admission, abort on disconnect);
its output is rendered back as output items or the typed event stream (server/responses_output.py).
Responses with `store` (the default) are kept by the context's ResponseStore (server/responses_store.py):
GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, and previous_response_id read it.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api_schema import errors, generation_responses
from server.chat import start_chat
from server.chat_output import ChatOutputFormat
from server.context import ServingContext, get_context, respond
from server.errors import APIError
from server.generation import ChoiceDelta, GenerationError, GenerationStream
from server.limits import StrictJSONRoute
from server.responses_output import ItemEvents, new_id, output_items
from server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
)
from server.responses_schema import RESPONSES_SSE_EVENT, DeletedResponse, ResponseItemList, ResponseObject
from server.responses_store import StoredResponse
from server.stream_response import ChoiceEvents

router = APIRouter(route_class=StrictJSONRoute)
_ITEMS = TypeAdapter(list[InputItem])
MAX_LIST_LIMIT = 100
_OMITTED_WHEN_NULL = ("user", "safety_identifier", "prompt_cache_key", "usage")


@router.post("/v1/responses", response_model=ResponseObject,
             responses=generation_responses(ResponseObject, events=RESPONSES_SSE_EVENT))
async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    ctx = get_context(raw_request)
    history: list[Any] = []
    if body.previous_response_id is not None:
        previous = ctx.responses.get(body.previous_response_id)
        if previous is None:        # OpenAI's answer: a 400 naming the field
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")
        history = previous.conversation
    request_id = new_id("resp")
    plan, stream = await start_chat(raw_request, body.to_chat(history), request_id, arrival)
    view = _ResponsesView(ctx, body, request_id, plan.output, history, stream.model)
    return await respond(raw_request, stream, view, body.stream)


async def other_methods(response_id: str) -> None:
    """Declared before GET and DELETE, so that a 405 names both in its Allow header (Starlette's 405 names the
    methods of the first route on the path); a plain route, which reads no body."""
    raise StarletteHTTPException(405, headers={"Allow": "GET, DELETE"})


router.add_api_route("/v1/responses/{response_id}", other_methods, methods=["POST", "PUT", "PATCH", "OPTIONS"],
                     include_in_schema=False, route_class_override=APIRoute)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=errors(404))
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    return JSONResponse(_stored(raw_request, response_id).response)       # as it was answered


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=errors(404))
async def delete_response(response_id: str, raw_request: Request) -> dict[str, Any]:
    if not get_context(raw_request).responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", response_model=ResponseItemList, responses=errors(400, 404))
async def list_input_items(response_id: str, raw_request: Request,
                           limit: int = Query(20, ge=1, le=MAX_LIST_LIMIT),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None,
                           include: list[str] | None = Query(None)) -> dict[str, Any]:
    """OpenAI's pages: newest first unless order is asc; `after` an item id of the previous page."""
    items = list(_stored(raw_request, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"No input item with id {after!r} in response {response_id!r}.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id {response_id!r} found (it was never stored, or was deleted or "
                         "evicted: see --responses-store-size).", param="response_id", code="not_found")


def _stored(raw_request: Request, response_id: str) -> StoredResponse:
    stored = get_context(raw_request).responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def input_resources(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input items as GET .../input_items lists them: each with an id, text as content parts."""
    out = []
    for item in body.items():
        data = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem):
            # Text parts as the spec types them: output_text in an assistant message, input_text elsewhere.
            kind = "output_text" if item.role == "assistant" else "input_text"
            extra = {"annotations": [], "logprobs": []} if kind == "output_text" else {}
            parts = [{"type": kind, "text": item.content}] if isinstance(item.content, str) else data["content"]
            parts = [p if p["type"] == "refusal" else {"type": kind, "text": p["text"], **extra} for p in parts]
            data = {**data, "id": item.id or new_id("msg"), "content": parts, "status": item.status or "completed"}
        elif isinstance(item, FunctionCallItem):
            data = {**data, "id": item.id or "fc_" + item.call_id.removeprefix("call_"),
                    "status": item.status or "completed"}
        elif isinstance(item, FunctionCallOutputItem):
            data = {**data, "id": item.id or new_id("fco"), "status": item.status or "completed"}
        else:
            data = {"summary": [], **data, "id": item.id or new_id("rs")}
        out.append(data)
    return out


class _ResponsesView:
    def __init__(self, ctx: ServingContext, body: ResponsesRequest, resp_id: str, output: ChatOutputFormat,
                 history: list[Any], model: str) -> None:
        self.ctx, self.body, self.id, self.output, self.history = ctx, body, resp_id, output, history
        self.model = model      # the served model's name, or the LoRA adapter's the request asked for
        self.created = int(time.time())
        self.deltas = output.stream()
        self.items = ItemEvents()
        self.finish: str | None = None
        self.started = False

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                finish_reason: str | None = None) -> dict[str, Any]:
        body, defaults = self.body, self.ctx.info.default_sampling
        tools = [tool.model_dump() for tool in body.tools or ()]
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {}
        response = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": body.instructions, "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "temperature": float(body.temperature if body.temperature is not None else defaults.get("temperature", 1.0)),
            "top_p": float(body.top_p if body.top_p is not None else defaults.get("top_p", 1.0)),
            "tools": tools, "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "text": {"format": {"type": "text"}, **text},
            "reasoning": None, "truncation": "disabled", "store": body.store, "background": False,
            "service_tier": "default", "user": body.user, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key, "usage": usage,
        }
        # OpenAI's schema has no null for these: left out when unset (usage: until the end).
        return {k: v for k, v in response.items() if v is not None or k not in _OMITTED_WHEN_NULL}

    def _usage(self, stream: GenerationStream, output: list[dict[str, Any]]) -> dict[str, Any]:
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
        reasoning_tokens = len(self.ctx.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        prompt, generated = stream.num_prompt_tokens, stream.num_completion_tokens
        cached = min(stream.num_cached_tokens, prompt)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, generated)},
                "total_tokens": prompt + generated}

    def _finished(self, stream: GenerationStream, output: list[dict[str, Any]], finish_reason: str | None
                  ) -> dict[str, Any]:
        """The whole response, stored when it asked to be."""
        status = "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"
        response = self._object(status, output, self._usage(stream, output), finish_reason)
        if self.body.store:
            conversation = [*self.history, *self.body.items(), *_ITEMS.validate_python(output)]
            self.ctx.responses.put(StoredResponse(response, input_resources(self.body), conversation))
        return response

    def response(self, stream: GenerationStream) -> dict[str, Any]:
        [choice] = stream.choices
        message, finish_reason = self.output.message(choice.text, choice.finish_reason)
        status = "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"
        return self._finished(stream, output_items(message, status), finish_reason)

    def events(self, stream: GenerationStream) -> ChoiceEvents:
        self.stream = stream
        start = self._object("in_progress", [], None)
        self.opening = (self.items.event("response.created", response=start)
                        + self.items.event("response.in_progress", response=start))
        # Like chat's role chunk, these go out with the first tokens, not before the prefill.
        return ChoiceEvents(self._render, with_first_update=self.opening, end=self._end, error=self._error)

    def _render(self, d: ChoiceDelta) -> bytes:
        self.started = True
        finished = d.finish_reason is not None
        piece = self.items.delta(self.deltas.delta(d.text, finished))
        if finished:
            self.finish = self.deltas.finish_reason(d.finish_reason)
        return piece

    def _unopened(self) -> bytes:
        """The opening events, when the stream ends before any update carried them."""
        if self.started:
            return b""
        self.started = True
        return self.opening

    def _end(self) -> bytes:
        head = self._unopened()
        status = "completed" if self.finish in ("stop", "tool_calls") else "incomplete"
        tail = self.items.finish(status)
        response = self._finished(self.stream, self.items.items, self.finish)
        return head + tail + self.items.event(f"response.{status}", response=response)

    def _error(self, exc: GenerationError) -> bytes:
        head = self._unopened()
        response = self._object("failed", self.items.items, None)
        response["error"] = {"code": "server_error", "message": f"Generation failed: {exc}."}
        return head + self.items.event("response.failed", response=response)

