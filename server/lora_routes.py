"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), served with --allow-runtime-lora-updating.

The engine reads and checks the adapter directory between two steps and answers; its reason for refusing one
(missing directory, rank above --max-lora-rank, modules the model lacks...) is the 400's message.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from engine.messages import LoadLoRA, UnloadLoRA
from server.api_schema import errors
from server.context import get_context
from server.errors import APIError

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors(400, 503))
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw_request: Request) -> PlainTextResponse:
    ctx = get_context(raw_request)
    if not body.lora_name.strip() or not body.lora_path.strip():
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    adapter = ctx.loras.new_adapter(body.lora_name, body.lora_path)
    ctx.loras.loading.add(adapter.lora_name)
    try:
        error = await ctx.control_lora(LoadLoRA(f"lora-load-{adapter.lora_int_id}", adapter))
    finally:
        ctx.loras.loading.discard(adapter.lora_name)
    if error is not None:
        raise APIError(400, f"The LoRA adapter '{body.lora_name}' cannot be loaded: {error}")
    ctx.loras.adapters[adapter.lora_name] = adapter
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=errors(400, 404, 503))
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw_request: Request) -> PlainTextResponse:
    ctx = get_context(raw_request)
    adapter = ctx.loras.adapters.get(body.lora_name)
    if adapter is None or (body.lora_int_id is not None and body.lora_int_id != adapter.lora_int_id):
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", code="model_not_found")
    error = await ctx.control_lora(UnloadLoRA(f"lora-unload-{adapter.lora_int_id}", adapter.lora_int_id))
    if error is not None:
        raise APIError(400, f"The LoRA adapter '{body.lora_name}' cannot be unloaded now: {error}")
    del ctx.loras.adapters[body.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
