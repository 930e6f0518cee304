"""`pagedserve` command line: one subcommand per job (serve; bench is added beside it).

A subcommand is a function `register(subparsers)` that adds its parser and sets `func` (args -> exit
code); adding one is one line in COMMANDS.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from server.settings import ServeSettings, add_serve_arguments, resolve_settings

logger = logging.getLogger("pagedserve")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def register_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="Run the OpenAI-compatible HTTP server.",
        description="Serve a model over an OpenAI-compatible HTTP API. Every flag can also come from the "
                    "environment (PAGEDSERVE_<FLAG>) or a YAML file (--config); flags win over the environment, "
                    "which wins over the file.")
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    # Listed here for `pagedserve --help`; its own parser lives in server/bench/, imported only when
    # `pagedserve bench ...` runs (main() hands it the rest of the command line).
    subparsers.add_parser("bench", help="Benchmarks: offline throughput, or a client against a server.",
                          add_help=False)


def run_bench(argv: list[str]) -> int:
    from server import bench
    return bench.main(argv)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [register_serve, register_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: an OpenAI-compatible LLM server.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(subparsers)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    try:
        settings = resolve_settings(args)
        config = settings.engine_config()
    except ValueError as exc:
        print(f"pagedserve serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format=_LOG_FORMAT)
    if config.node_rank > 0:    # another node of a multi-node tensor-parallel engine: its ranks, no HTTP
        return run_worker_node(config)
    return serve(settings, config)


def run_worker_node(config: EngineConfig) -> int:
    from engine.distributed.workers import run_node
    try:
        return run_node(config)
    except ValueError as exc:
        print(f"pagedserve serve: error: {exc}", file=sys.stderr)
        return 2


def chat_options(settings: ServeSettings):
    from server.chat_plan import ChatOptions
    return ChatOptions(settings.enable_auto_tool_choice, settings.tool_call_parser, settings.reasoning_parser)


def serve(settings: ServeSettings, config: EngineConfig) -> int:
    from server import faults
    from server.app import create_app
    from server.dashboard.collector import DashboardOptions
    from server.engine_process import EngineStartupError, ProcessEngineClient
    from server.process import exit_now, run_server
    from server.security import default_allowed_hosts

    logger.info("starting the engine process for model %s", config.model)
    try:
        client = ProcessEngineClient(config, log_level=settings.log_level)
    except EngineStartupError as exc:
        logger.error("the engine could not start: %s", exc)
        return 1
    info = client.info
    name = settings.served_model_name or info.model_name
    logger.info("model=%s served as %r device=%s dtype=%s attention=%s kv_blocks=%d (block size %d) "
                "max_model_len=%d; engine process pid %s", info.model_name, name, info.device, info.dtype,
                info.attention_backend, info.num_kv_blocks, info.block_size, info.max_model_len, client.pid)
    try:
        app = create_app(client, served_model_name=name, max_body_bytes=settings.max_body_bytes,
                         stream_interval=settings.stream_interval, max_queue_len=settings.max_queue_len,
                         request_timeout=settings.request_timeout, engine_stall_timeout=settings.engine_stall_timeout,
                         api_key=settings.api_key, allowed_origins=settings.allowed_origins,
                         fault_injection=faults.enabled(), chat_options=chat_options(settings),
                         allowed_hosts=settings.allowed_hosts or default_allowed_hosts(settings.host),
                         dashboard=DashboardOptions(settings.dashboard, settings.dashboard_show_prompts),
                         vllm_metric_names=settings.vllm_metric_names,
                         allow_runtime_lora_updating=settings.allow_runtime_lora_updating,
                         responses_store_size=settings.responses_store_size)
    except (ValueError, OSError) as exc:
        logger.error("cannot start the front end: %s", exc)
        asyncio.run(client.shutdown(5.0))
        return 2
    bridge = app.state.ctx.async_engine
    if not settings.api_key and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                       settings.host)
    logger.info("serving on http://%s:%d (OpenAI base URL http://%s:%d/v1); queue up to %d waiting requests; "
                "API key %s; CORS origins: %s", settings.host, settings.port, settings.host, settings.port,
                bridge.admission.max_queue_len, "required" if settings.api_key else "not required",
                ", ".join(settings.allowed_origins) or "none")
    if settings.dashboard:
        logger.info("dashboard on http://%s:%d/dashboard", settings.host, settings.port)
    exit_now(run_server(app, settings.host, settings.port, drain_timeout=settings.drain_timeout,
                        log_level=settings.log_level, access_log=settings.access_log))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
