"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A Messages request becomes the chat request it means (server/messages_protocol.py) and runs exactly as
/v1/chat/completions runs one (server/chat.py: template, tools, constraint, admission, abort on disconnect);
its output is rendered back as Anthropic's message or event stream (server/messages_output.py). Errors on
these paths are in Anthropic's shape (server/errors.py picks it by path).
"""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api_schema import AnthropicMessage, CountTokensResponse, errors, generation_responses
from server.chat import plan_request, start_chat
from server.chat_output import ChatOutputFormat
from server.context import get_context, respond, response_id
from server.errors import anthropic_error_body
from server.generation import ChoiceDelta, GenerationError, GenerationStream
from server.limits import StrictJSONRoute
from server.messages_output import BlockEvents, content_blocks, sse, stop_reason
from server.messages_protocol import CountTokensRequest, MessagesRequest
from server.stream_response import ChoiceEvents

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/messages", response_model=AnthropicMessage,
             responses=generation_responses(AnthropicMessage, anthropic=True))
async def create_message(body: MessagesRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    request_id = response_id("msg").replace("-", "_", 1)       # Anthropic's ids: msg_...
    plan, stream = await start_chat(raw_request, body.to_chat(), request_id, arrival)
    view = _MessagesView(request_id, plan.output, stream.model)
    return await respond(raw_request, stream, view, body.stream)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
             responses=errors(400, 404, 413, anthropic=True))
async def count_tokens(body: CountTokensRequest, raw_request: Request) -> dict[str, int]:
    get_context(raw_request).check_model(body.model)
    # Counted as /v1/messages renders it, even when it is too long for the context (that is what one asks).
    plan = await plan_request(raw_request, body.chat_request(), check_length=False)
    return {"input_tokens": len(plan.prompt)}


class _MessagesView:
    def __init__(self, message_id: str, output: ChatOutputFormat, model: str) -> None:
        self.id, self.output, self.model = message_id, output, model
        self.deltas = output.stream()
        self.blocks = BlockEvents()
        self.finish: tuple[str, str | None] = ("end_turn", None)

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content,
                "model": self.model, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

    def response(self, stream: GenerationStream) -> dict[str, Any]:
        [choice] = stream.choices
        message, finish_reason = self.output.message(choice.text, choice.finish_reason)
        reason, sequence = stop_reason(finish_reason, choice.stop_reason)
        return self._message(content_blocks(message), reason, sequence, stream.num_prompt_tokens,
                             stream.num_completion_tokens)

    def events(self, stream: GenerationStream) -> ChoiceEvents:
        self.stream = stream
        # Like chat's role chunk, message_start goes out with the first tokens, not before the prefill.
        start = sse("message_start", {"type": "message_start", "message": self._message(
            [], None, None, stream.num_prompt_tokens, 0)})
        return ChoiceEvents(self._render, with_first_update=start, end=self._end, error=_error_event)

    def _render(self, d: ChoiceDelta) -> bytes:
        finished = d.finish_reason is not None
        piece = self.blocks.delta(self.deltas.delta(d.text, finished))
        if finished:
            self.finish = stop_reason(self.deltas.finish_reason(d.finish_reason), d.stop_reason)
        return piece

    def _end(self) -> bytes:
        return self.blocks.finish(*self.finish, self.stream.num_completion_tokens)


def _error_event(exc: GenerationError) -> bytes:
    return sse("error", anthropic_error_body(exc.status, f"Generation failed: {exc}."))
