"""POST /v1/completions."""
from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from engine.output_processor import RequestProcessor
from server.api_schema import CompletionResponse, generation_responses
from server.context import ServingContext, get_context, respond, response_id
from server.generation import ChoiceDelta, GenerationStream
from server.limits import StrictJSONRoute
from server.logprobs import OffsetCounter, completion_logprobs, prompt_logprobs_list
from server.protocol import MAX_BATCH_PROMPTS, CompletionRequest, usage_dict
from server.sse import ChunkFormat
from server.stream_response import ChoiceEvents
from server.text_work import TextWork

router = APIRouter(route_class=StrictJSONRoute)


async def tokenize_prompts(text: TextWork, tokenizer: PreTrainedTokenizerBase, prompt: str | list,
                           field: str = "prompt") -> tuple[list[list[int]], list[str | None]]:
    """The four prompt forms -> token ids per prompt, and the prompt text where the client sent text.
    A text too long for any tokenization to fit the context is refused before it is tokenized; long ones
    are tokenized off the event loop. field: the request's name for the prompt, in error messages."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts:
        raise ValueError(f"{field} must not be empty.")
    if isinstance(prompts[0], int):
        prompts = [prompts]
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise ValueError(f"at most {MAX_BATCH_PROMPTS} {field}s per request, got {len(prompts)}.")
    if isinstance(prompts[0], str):
        if not all(prompts):
            raise ValueError(f"{field} must not be empty.")
        for p in prompts:
            text.check_prompt_chars(p, field)
        ids = await text.run(sum(map(len, prompts)), _encode, tokenizer, prompts)
        return ids, list(prompts)
    return [list(p) for p in prompts], [None] * len(prompts)


def _encode(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    return tokenizer(prompts, add_special_tokens=True)["input_ids"]


@router.post("/v1/completions", response_model=CompletionResponse,
             responses=generation_responses(CompletionResponse))
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    ctx = get_context(raw_request)
    lora = ctx.check_model(body.model)
    body.validate_request()
    prompts, texts = await tokenize_prompts(ctx.text, ctx.tokenizer, body.prompt)
    params = body.sampling_params(body.max_tokens, body.logprobs, ctx.info.default_sampling, body.constraint(),
                                  prompt_logprobs=body.engine_prompt_logprobs)
    request_id = response_id("cmpl")
    view = _CompletionView(ctx, body, request_id, prompts, texts)
    stream = ctx.start(request_id, prompts, params, arrival, lora)
    return await respond(raw_request, stream, view, body.stream)


class _CompletionView:
    """Renders one completion request's choices, streamed or whole."""

    def __init__(self, ctx: ServingContext, body: CompletionRequest, response_id: str,
                 prompts: list[list[int]], texts: list[str | None]) -> None:
        self.ctx, self.body, self.id, self.prompts, self.texts = ctx, body, response_id, prompts, texts
        self.created = int(time.time())
        # text_offset runs on across a choice's chunks (and starts after the echoed prompt).
        self.offsets = [OffsetCounter(body.skip_special_tokens) for _ in range(len(prompts) * body.n)]

    @functools.cached_property
    def echo_texts(self) -> list[str] | None:
        """The prompts as echoed: the client's text, or the decoded ids (after the engine checked them)."""
        if not self.body.echo:
            return None
        skip = self.body.skip_special_tokens
        return [t if t is not None else self.ctx.tokenizer.decode(ids, skip_special_tokens=skip)
                for t, ids in zip(self.texts, self.prompts)]

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list | None,
                  prompt: RequestProcessor | None) -> dict[str, Any] | None:
        """prompt: the choice's engine request when its echoed prompt comes first (scored by the engine but
        for its first token)."""
        if self.body.logprobs is None:
            return None
        if prompt is None:
            return completion_logprobs(self.ctx.token_text, self.offsets[index], token_ids, logprobs or [],
                                       self.body.logprobs)
        scored = prompt.prompt_logprobs or []
        return completion_logprobs(self.ctx.token_text, self.offsets[index], prompt.prompt_token_ids + token_ids,
                                   scored + (logprobs or []), self.body.logprobs,
                                   num_unscored=len(prompt.prompt_token_ids) - len(scored))

    def _choice(self, index: int, text: str, logprobs: dict | None, finish: str | None,
                stop_reason: int | str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return choice

    def response(self, stream: GenerationStream) -> dict[str, Any]:
        choices = []
        for c in stream.choices:
            request = stream.requests[c.index // self.body.n]
            prefix = self.echo_texts[c.index // self.body.n] if self.echo_texts else ""
            logprobs = self._logprobs(c.index, c.token_ids, c.logprobs, request if self.body.echo else None)
            choice = self._choice(c.index, prefix + c.text, logprobs, c.finish_reason, c.stop_reason)
            if self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_list(
                    self.ctx.token_text, request.prompt_logprobs or [], self.body.prompt_logprobs)
            choices.append(choice)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": stream.model, "choices": choices,
                "usage": usage_dict(stream.num_prompt_tokens, stream.num_completion_tokens)}

    def events(self, stream: GenerationStream) -> ChoiceEvents:
        self.stream = stream
        self.fmt = ChunkFormat(self.id, "text_completion", self.created, stream.model,
                               text_choice=b'{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}')
        # An echoed prompt goes out in front of its choice's first update, which brings its prompt logprobs.
        self.unechoed = set(range(len(stream.choices))) if self.echo_texts else set()
        return ChoiceEvents(self._delta_event, self.fmt if self.body.include_usage else None)

    def _delta_event(self, d: ChoiceDelta) -> bytes:
        echo = self._echo_event(d.index) if self.unechoed else b""
        if d.finish_reason is None and self.body.logprobs is None:   # most chunks: text only
            return echo + self.fmt.text_event(d.index, d.text) if d.text else echo
        choice = self._delta_choice(d)
        return echo if choice is None else echo + self.fmt.event(choice)

    def _echo_event(self, index: int) -> bytes:
        if index not in self.unechoed:
            return b""
        self.unechoed.discard(index)
        prompt = index // self.body.n
        logprobs = self._logprobs(index, [], [], self.stream.requests[prompt])
        return self.fmt.event(self._choice(index, self.echo_texts[prompt], logprobs, None, None))

    def _delta_choice(self, d: ChoiceDelta) -> dict[str, Any] | None:
        # Tokens whose text is still held back (a partial character, a possible stop string) make no
        # chunk, unless they carry logprobs.
        if not (d.text or d.finish_reason or (d.token_ids and self.body.logprobs is not None)):
            return None
        logprobs = self._logprobs(d.index, d.token_ids, d.logprobs, None) if d.token_ids else None
        return self._choice(d.index, d.text, logprobs, d.finish_reason, d.stop_reason)
