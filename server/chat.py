"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from server.api_schema import ChatCompletionResponse, generation_responses
from server.context import ServingContext, get_context, respond
from server.generation import ChoiceDelta, GenerationStream
from server.limits import StrictJSONRoute
from server.logprobs import chat_logprobs
from server.protocol import ChatCompletionRequest, ChatMessage, usage_dict
from server.sse import ChunkFormat, choice_events

router = APIRouter(route_class=StrictJSONRoute)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """Chat template -> prompt token ids. The template writes any BOS itself, so no special tokens are added."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions instead.")
    try:
        text = tokenizer.apply_chat_template([m.for_template() for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template cannot render these messages: {exc}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=generation_responses(ChatCompletionResponse))
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    ctx = get_context(raw_request)
    ctx.check_model(body.model)
    body.validate_request()
    prompt = render_chat(ctx.tokenizer, body.messages, body.add_generation_prompt)
    params = body.sampling_params(body.max_new_tokens, body.num_logprobs, ctx.info.default_sampling)
    view = _ChatView(ctx, body, f"chatcmpl-{uuid.uuid4().hex}")
    stream = ctx.start(view.id, [prompt], params, arrival)
    return await respond(raw_request, stream, view, body.stream)


class _ChatView:
    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, response_id: str) -> None:
        self.ctx, self.body, self.id = ctx, body, response_id
        self.created = int(time.time())

    def _logprobs(self, token_ids: list[int], logprobs: list | None) -> dict[str, Any] | None:
        if self.body.num_logprobs is None:
            return None
        return chat_logprobs(self.ctx.token_text, token_ids, logprobs or [], self.body.num_logprobs)

    def response(self, stream: GenerationStream) -> dict[str, Any]:
        choices = [{"index": c.index,
                    "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in stream.choices]
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.ctx.served_model_name, "choices": choices,
                "usage": usage_dict(stream.num_prompt_tokens, stream.num_completion_tokens)}

    def events(self, stream: GenerationStream) -> AsyncIterator[str]:
        fmt = ChunkFormat(self.id, "chat.completion.chunk", self.created, self.ctx.served_model_name)
        # The first chunk of each choice announces the role, as OpenAI's stream does. It goes out with the
        # first tokens, not before the prefill: clients time the first token from the first chunk (vLLM too).
        role = "".join(fmt.event({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}) for c in stream.choices)
        return choice_events(stream, fmt, self._delta_choice, self.body.include_usage, with_first_update=role)

    def _delta_choice(self, d: ChoiceDelta) -> dict[str, Any] | None:
        if not (d.text or d.finish_reason or (d.token_ids and self.body.logprobs)):
            return None
        choice: dict[str, Any] = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                                  "finish_reason": d.finish_reason}
        if self.body.num_logprobs is not None:
            choice["logprobs"] = self._logprobs(d.token_ids, d.logprobs)
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_reason
        return choice
