"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's utility endpoints)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.api_schema import DetokenizeResponse, TokenizeResponse, TokenizerInfoResponse, errors
from server.chat_template import render_chat
from server.context import ServingContext, get_context
from server.limits import StrictJSONRoute
from server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 404, 413))
async def tokenize(body: TokenizeRequest, raw_request: Request) -> dict[str, Any]:
    ctx = get_context(raw_request)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ValueError("send exactly one of prompt (text) or messages (chat).")
    # A big input is rendered and tokenized off the event loop (measured by its body).
    tokens, strs = await ctx.text.run(len(await raw_request.body()), _tokenize, ctx, body)
    return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens, "token_strs": strs}


def _tokenize(ctx: ServingContext, body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    if body.messages is not None:
        tokens = render_chat(ctx.tokenizer, body.messages, body.add_generation_prompt)
    else:
        tokens = ctx.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    strs = [s for s, _ in ctx.token_text.pieces(tokens)] if body.return_token_strs else None
    return tokens, strs


@router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 404, 413))
async def detokenize(body: DetokenizeRequest, raw_request: Request) -> dict[str, str]:
    ctx = get_context(raw_request)
    ctx.check_model(body.model)
    vocab_size, tokens = ctx.info.vocab_size, body.tokens
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is out of vocabulary (valid ids are 0..{vocab_size - 1}).")
    return {"prompt": await ctx.text.run(len(tokens), ctx.tokenizer.decode, tokens)}


@router.get("/tokenizer_info", response_model=TokenizerInfoResponse)
async def tokenizer_info(raw_request: Request) -> dict[str, Any]:
    ctx = get_context(raw_request)
    tok = ctx.tokenizer
    return {
        "tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
        "pad_token": tok.pad_token, "unk_token": tok.unk_token, "chat_template": tok.chat_template,
        "model_max_length": ctx.max_model_len, "vocab_size": ctx.info.vocab_size,
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "added_tokens": {str(i): t.content for i, t in sorted(tok.added_tokens_decoder.items())},
    }
