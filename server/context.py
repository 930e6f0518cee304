"""What every route needs: the model's info and tokenizer, the engine bridge, the served name, the metrics."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from engine.lora.request import LoRARequest
from engine.messages import LoRAControl
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from server.admission import Overloaded
from server.async_engine import AsyncEngine, EngineUnavailable
from server.chat_plan import ChatOptions
from server.errors import APIError, ClientDisconnected
from server.generation import GenerationError, GenerationStream
from server.logprobs import TokenText
from server.lora import LoRARegistry
from server.metrics import ServerMetrics
from server.responses_store import ResponseStore
from server.sse import await_or_disconnect
from server.stream_response import ChoiceEvents, SSEResponse, StepWriter
from server.text_work import TextWork


@dataclass
class ServingContext:
    info: ModelInfo                   # what the engine process reported when it was ready
    tokenizer: PreTrainedTokenizerBase    # loaded in this process from info.tokenizer
    async_engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str
    token_text: TokenText
    text: TextWork                    # tokenizer work on inputs, off the event loop when it is big
    created: int = field(default_factory=lambda: int(time.time()))
    options: ChatOptions = field(default_factory=ChatOptions)   # tool-call and reasoning parsers
    writer: StepWriter = field(default_factory=StepWriter)      # the streams' per-step rendering and writes
    responses: ResponseStore = field(default_factory=ResponseStore)     # POST /v1/responses' stored answers
    loras: LoRARegistry | None = None                           # the LoRA adapters served (None: built from info)

    def __post_init__(self) -> None:
        if self.loras is None:
            self.loras = LoRARegistry(self.served_model_name, self.info.max_loras,
                                      {a.lora_name: a for a in self.info.lora_modules})

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model names, None for the served model (also when empty or missing,
        as in vLLM); any other name is 404."""
        return self.loras.resolve(name)

    def start(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
              arrival_time: float, lora: LoRARequest | None = None) -> GenerationStream:
        try:
            stream = self.async_engine.generate(request_id, prompts, params, arrival_time, lora)
            stream.model = self.served_model_name if lora is None else lora.lora_name
            if params.structured_outputs is not None:
                self.metrics.constrained_requests.inc(len(prompts))
            return stream
        except EngineUnavailable as exc:
            raise APIError(503, f"The server cannot take requests now: {exc}.") from None
        except Overloaded as exc:
            self.metrics.rejected.inc()
            # A real status before any byte of a stream: routers and SDKs act on it (the SDK retries).
            raise APIError(429, str(exc), code="server_overloaded",
                           headers={"Retry-After": str(exc.retry_after)}) from None


    async def control_lora(self, control: LoRAControl) -> str | None:
        """Loads or unloads an adapter in the engine: its reason for refusing, or None."""
        try:
            return await self.async_engine.control_lora(control)
        except EngineUnavailable as exc:
            raise APIError(503, f"The server cannot change adapters now: {exc}.") from None


class View(Protocol):
    """How one endpoint renders a generation: as SSE events, or as one JSON body at the end."""
    def events(self, stream: GenerationStream) -> ChoiceEvents: ...
    def response(self, stream: GenerationStream) -> dict[str, Any]: ...


async def respond(request: Request, stream: GenerationStream, view: View, streaming: bool) -> Response:
    ctx = get_context(request)
    if streaming and stream.params.structured_outputs is not None:
        # Its grammar compiles in the engine first: a bad one must still get a 400, not a stream.
        try:
            error = await await_or_disconnect(request, stream.first_news())
        except ClientDisconnected:
            stream.close()
            return Response(status_code=499)
        if error is not None and error.status < 500:
            stream.close()
            raise APIError(error.status, str(error))
    if streaming:
        return SSEResponse(stream, view.events(stream), ctx.writer)
    try:
        await await_or_disconnect(request, stream.collect())
    except ClientDisconnected:
        return Response(status_code=499)     # nobody is listening; the request was aborted
    except GenerationError as exc:
        raise APIError(exc.status, str(exc) if exc.status < 500 else f"Generation failed: {exc}.") from None
    if stream.expired == "timeout":
        raise APIError(504, "The request ran longer than this server's --request-timeout and was aborted; "
                            "lower max_tokens or n, or use stream=true to keep what was generated.",
                       code="request_timeout")
    return JSONResponse(view.response(stream))


# Seeded from the OS once; an id then costs no system call (uuid4 reads os.urandom each time, a
# measurable part of a request's cost when hundreds arrive at once). Ids are unique, not secrets.
_ids = random.Random()


def response_id(prefix: str) -> str:
    """A response id as OpenAI's look: prefix-<32 hex digits>."""
    return f"{prefix}-{_ids.getrandbits(128):032x}"


def get_context(request: Request) -> ServingContext:
    return request.app.state.ctx
