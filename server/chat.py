"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api_schema import ChatCompletionResponse, generation_responses
from server.chat_output import ChatOutputFormat
from server.chat_plan import ChatPlan, plan_chat
from server.context import ServingContext, get_context, respond, response_id
from server.generation import ChoiceDelta, GenerationStream
from server.limits import StrictJSONRoute
from server.logprobs import chat_logprobs, prompt_logprobs_list
from server.protocol import ChatCompletionRequest, usage_dict
from server.sse import ChunkFormat
from server.stream_response import ChoiceEvents

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=generation_responses(ChatCompletionResponse))
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    request_id = response_id("chatcmpl")
    plan, stream = await start_chat(raw_request, body, request_id, arrival)
    view = _ChatView(get_context(raw_request), body, request_id, plan.output)
    return await respond(raw_request, stream, view, body.stream)


async def plan_request(raw_request: Request, body: ChatCompletionRequest, check_length: bool = True) -> ChatPlan:
    """The request's prompt, constraint and output format. Rendering and tokenizing a big conversation
    (measured by its body) runs off the event loop."""
    ctx = get_context(raw_request)
    return await ctx.text.run(len(await raw_request.body()), plan_chat, body, ctx.tokenizer, ctx.options,
                              ctx.text.check_prompt_chars if check_length else None)


async def start_chat(raw_request: Request, body: ChatCompletionRequest, request_id: str,
                     arrival: float) -> tuple[ChatPlan, GenerationStream]:
    """A chat request checked, planned and started in the engine (also what /v1/messages runs)."""
    ctx = get_context(raw_request)
    lora = ctx.check_model(body.model)
    body.validate_request()
    plan = await plan_request(raw_request, body)
    params = body.sampling_params(body.max_new_tokens, body.num_logprobs, ctx.info.default_sampling,
                                  plan.constraint, prompt_logprobs=body.prompt_logprobs)
    return plan, ctx.start(request_id, [plan.prompt], params, arrival, lora)


class _ChatView:
    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, response_id: str,
                 output: ChatOutputFormat) -> None:
        self.ctx, self.body, self.id, self.output = ctx, body, response_id, output
        self.created = int(time.time())
        self.deltas = [output.stream() for _ in range(body.n)]
        # No reasoning to split off and no tool calls to parse: a text delta is the content as it is.
        self.plain = output.in_reasoning is None and output.tools.kind == "none"

    def _logprobs(self, token_ids: list[int], logprobs: list | None) -> dict[str, Any] | None:
        if self.body.num_logprobs is None:
            return None
        return chat_logprobs(self.ctx.token_text, token_ids, logprobs or [], self.body.num_logprobs)

    def response(self, stream: GenerationStream) -> dict[str, Any]:
        choices = []
        for c in stream.choices:
            message, finish_reason = self.output.message(c.text, c.finish_reason)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        response = {"id": self.id, "object": "chat.completion", "created": self.created,
                    "model": stream.model, "choices": choices,
                    "usage": usage_dict(stream.num_prompt_tokens, stream.num_completion_tokens)}
        if self.body.prompt_logprobs is not None:     # vLLM's: the rendered prompt's tokens, scored
            response["prompt_logprobs"] = prompt_logprobs_list(
                self.ctx.token_text, stream.requests[0].prompt_logprobs or [], self.body.prompt_logprobs)
        return response

    def events(self, stream: GenerationStream) -> ChoiceEvents:
        self.fmt = fmt = ChunkFormat(self.id, "chat.completion.chunk", self.created, stream.model,
                                     text_choice=b'{"index":%d,"delta":{"content":%s},"finish_reason":null}')
        # The first chunk of each choice announces the role, as OpenAI's stream does. It goes out with the
        # first tokens, not before the prefill: clients time the first token from the first chunk (vLLM too).
        role = b"".join(fmt.event({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}) for c in stream.choices)
        return ChoiceEvents(self._delta_event, fmt if self.body.include_usage else None, with_first_update=role)

    def _delta_event(self, d: ChoiceDelta) -> bytes:
        if d.finish_reason is None and self.plain and self.body.num_logprobs is None:   # most chunks
            return self.fmt.text_event(d.index, d.text) if d.text else b""
        choice = self._delta_choice(d)
        return b"" if choice is None else self.fmt.event(choice)

    def _delta_choice(self, d: ChoiceDelta) -> dict[str, Any] | None:
        if not (d.text or d.finish_reason or (d.token_ids and self.body.logprobs)):
            return None
        state = self.deltas[d.index]
        delta = state.delta(d.text, d.finish_reason is not None)
        if not (delta or d.finish_reason or (d.token_ids and self.body.logprobs)):
            return None     # text held back (a partial tag) makes no chunk
        choice: dict[str, Any] = {"index": d.index, "delta": delta, "finish_reason": state.finish_reason(d.finish_reason)}
        if self.body.num_logprobs is not None:
            choice["logprobs"] = self._logprobs(d.token_ids, d.logprobs)
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_reason
        return choice
