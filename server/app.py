"""The FastAPI app: routes, limits, error envelope, and the engine client's lifetime (lifespan)."""
from __future__ import annotations

import contextlib
import importlib.metadata
import pathlib
import tomllib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from server import chat, completions, embeddings, faults, lora_routes, messages, responses, tokenization
from server.api_schema import ModelCard, ModelList, VersionResponse, errors, install_openapi
from server.async_engine import AsyncEngine
from server.chat_plan import ChatOptions
from server.context import ServingContext, get_context
from server.dashboard.collector import DashboardOptions, StatsCollector
from server.dashboard.routes import install_dashboard
from server.direct_routes import DirectRoute, DirectRoutes
from server.engine_client import EngineClient
from server.errors import error_response, install_error_handlers, model_not_found
from server.limits import DEFAULT_MAX_BODY_BYTES, RequestSizeLimitMiddleware
from server.load_report import install_load_route
from server.logprobs import TokenText
from server.messages_protocol import MessagesRequest
from server.metrics import CONTENT_TYPE, EndpointLabel, ServerMetrics
from server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from server.responses_protocol import ResponsesRequest
from server.responses_store import DEFAULT_STORE_SIZE, ResponseStore
from server.security import install_access_control
from server.text_work import TextWork
from server.tool_prompt import detect_tool_support

_SHOWN_TOKENS = 512          # of a prompt or output on the dashboard


def version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:     # running from a checkout that is not installed
        pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
        with contextlib.suppress(OSError, KeyError, tomllib.TOMLDecodeError):
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        return "unknown"


def create_app(client: EngineClient, *, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, stream_interval: int = 1,
               max_queue_len: int | None = None, request_timeout: float | None = None,
               engine_stall_timeout: float | None = None, api_key: str | None = None,
               allowed_origins: tuple[str, ...] = (), fault_injection: bool = False,
               chat_options: ChatOptions | None = None, allowed_hosts: tuple[str, ...] = ("*",),
               dashboard: DashboardOptions | None = None, vllm_metric_names: bool = False,
               allow_runtime_lora_updating: bool = False,
               responses_store_size: int = DEFAULT_STORE_SIZE) -> FastAPI:
    """An app serving the engine behind `client` (already started and ready); the app's lifespan attaches
    the client to its event loop, and shuts the engine down at the end.

    max_queue_len: engine requests that may wait (None: 4 x max_num_seqs); request_timeout: seconds a request
    may run (None: no limit); engine_stall_timeout: seconds without a step, work pending, before /health
    answers 503; api_key: required as a Bearer token on every route but /health and /metrics;
    allowed_origins: CORS origins (none: no CORS headers); fault_injection: the test-only /_fault routes;
    allowed_hosts: Host header names answered ("*": any); dashboard: GET /dashboard and /v1/stats (on unless
    its `enabled` is False); vllm_metric_names: /metrics also under vLLM's names (vllm:*);
    allow_runtime_lora_updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter; responses_store_size:
    responses of POST /v1/responses kept for GET /v1/responses/{id} and previous_response_id (0: none)."""
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1, got {stream_interval}.")
    info = client.info
    name = served_model_name or info.model_name
    tokenizer = info.tokenizer.load()
    chat_options = replace(chat_options or ChatOptions(), inject_tools=detect_tool_support(tokenizer))
    if chat_options.enable_auto_tool_choice and chat_options.auto_tool_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json) for this "
                         "model, whose chat template renders tools in its own format.")
    metrics = ServerMetrics(name, info.max_model_len, vllm_metric_names, info.max_loras, info.num_speculative_tokens)
    metrics.model_weight_bytes.set(info.model_weight_bytes)
    bridge = AsyncEngine(client, tokenizer, metrics, stream_interval, max_queue_len, request_timeout,
                         engine_stall_timeout)
    ctx = ServingContext(info, tokenizer, bridge, metrics, name, TokenText(tokenizer),
                         TextWork(tokenizer, info.max_model_len), options=chat_options,
                         responses=ResponseStore(responses_store_size))
    dashboard = dashboard or DashboardOptions()
    if dashboard.enabled:
        bridge.observer = StatsCollector(info, metrics, name, version(), dashboard, decode_text=_text_of(tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await ctx.async_engine.start()
        try:
            yield
        finally:
            ctx.text.shutdown()
            await ctx.async_engine.shutdown()

    app = FastAPI(title="pagedserve", version=version(), lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    # Innermost of the server's middleware: every check above still applies to the routes it takes.
    app.add_middleware(DirectRoutes, routes=_direct_routes(), exception_handlers=app.exception_handlers)
    app.add_middleware(RequestSizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(EndpointLabel)
    install_access_control(app, api_key, allowed_origins, allowed_hosts)   # outermost: before the body is read
    for module in (completions, chat, embeddings, messages, responses, tokenization):
        app.include_router(module.router)
    _add_service_routes(app)
    if allow_runtime_lora_updating:
        app.include_router(lora_routes.router)
    install_load_route(app)
    if bridge.observer is not None:
        install_dashboard(app, bridge.observer, api_key_required=bool(api_key))
    if fault_injection:
        faults.install_fault_routes(app, client)
    install_openapi(app, api_key_required=bool(api_key))
    return app


def _direct_routes() -> dict[str, DirectRoute]:
    """The generation and embedding routes, taken below FastAPI's routing (server/direct_routes.py)."""
    return {"/v1/completions": DirectRoute(CompletionRequest, completions.create_completion),
            "/v1/chat/completions": DirectRoute(ChatCompletionRequest, chat.create_chat_completion),
            "/v1/messages": DirectRoute(MessagesRequest, messages.create_message),
            "/v1/responses": DirectRoute(ResponsesRequest, responses.create_response),
            "/v1/embeddings": DirectRoute(EmbeddingRequest, embeddings.create_embedding)}


def _text_of(tokenizer) -> Callable[[list[int]], str]:
    def text(token_ids: list[int]) -> str:     # for --dashboard-show-prompts only, and only when polled
        return tokenizer.decode(token_ids[:_SHOWN_TOKENS]) + (" …" if len(token_ids) > _SHOWN_TOKENS else "")
    return text


def _model_cards(ctx: ServingContext) -> list[dict[str, Any]]:
    """The served model, then each LoRA adapter ({id: its name, parent: the served model, root: its path})."""
    base = {"id": ctx.served_model_name, "object": "model", "created": ctx.created, "owned_by": "pagedserve",
            "root": ctx.info.model_name, "parent": None, "max_model_len": ctx.max_model_len}
    return [base, *({**base, "id": name, "root": path, "parent": ctx.served_model_name}
                    for name, path in ctx.loras.cards())]


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": _model_cards(get_context(request))}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=errors(404))
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        card = next((c for c in _model_cards(get_context(request)) if c["id"] == model), None)
        if card is None:
            raise model_not_found(model)
        return card

    @app.get("/health", response_class=Response, responses={200: {"description": "The engine is running."},
                                                            **errors(503)})
    async def health(request: Request) -> Response:
        bridge = get_context(request).async_engine
        if bridge.alive:
            return Response(status_code=200)
        return error_response(503, f"Not ready: {bridge.unavailable_reason}.")

    @app.get("/version", response_model=VersionResponse)
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format.", "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics(request: Request) -> Response:
        return Response(get_context(request).metrics.render(), media_type=CONTENT_TYPE)
