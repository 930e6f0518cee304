"""POST /v1/embeddings: each input's final hidden states pooled (--pooling-type) and L2-normalized.

An embedding request takes the path of a completion request (ServingContext.start): the same checks at the
door, admission (429), --request-timeout, abort when the client goes away. In the engine each input is a
prefill-only request that samples nothing and keeps no KV block once done (engine/pooling.py).
"""
from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.pooling import embedding_params, embedding_values
from server.api_schema import EmbeddingResponse, errors
from server.completions import tokenize_prompts
from server.context import ServingContext, get_context, respond, response_id
from server.errors import APIError
from server.generation import GenerationStream
from server.limits import StrictJSONRoute
from server.protocol import EmbeddingRequest

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/embeddings", response_model=EmbeddingResponse,
             responses=errors(400, 404, 413, 429, 500, 503, 504))
async def create_embedding(body: EmbeddingRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    ctx = get_context(raw_request)
    lora = ctx.check_model(body.model)
    body.validate_request()
    prompts, _ = await tokenize_prompts(ctx.text, ctx.tokenizer, body.input, field="input")
    stream = ctx.start(response_id("embd"), prompts, embedding_params(), arrival, lora)
    return await respond(raw_request, stream, _EmbeddingView(ctx, body), streaming=False)


def _base64(data: bytes) -> str:
    """What the OpenAI SDK decodes: base64 of the little-endian float32 values (the engine's bytes)."""
    return base64.b64encode(data).decode("ascii")


class _EmbeddingView:
    """The response of one embedding request (never streamed)."""

    def __init__(self, ctx: ServingContext, body: EmbeddingRequest) -> None:
        self.ctx, self.body = ctx, body

    def response(self, stream: GenerationStream) -> dict[str, Any]:
        encode = _base64 if self.body.encoding_format == "base64" else embedding_values
        data = []
        for index, request in enumerate(stream.requests):
            if request.embedding is None:     # the engine finished it without a vector: a bug, not the user's
                raise APIError(500, "Generation failed: the engine returned no embedding.")
            data.append({"object": "embedding", "index": index, "embedding": encode(request.embedding)})
        tokens = stream.num_prompt_tokens
        return {"object": "list", "data": data, "model": stream.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
