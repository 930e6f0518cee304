"""GET /get_load: the load report of SGLang's workers, which vllm-router and sglang-router poll for their
power_of_two policy (they sum `num_tokens` over the list, one entry per data-parallel rank; without the
route they fall back on counting their own requests in flight). Built from the last step's engine stats."""
from __future__ import annotations

from fastapi import FastAPI, Request

from server.context import get_context


def load_report(num_running: int, num_waiting: int, kv_blocks_used: int, block_size: int) -> list[dict[str, int]]:
    # One rank: pagedserve runs no data parallelism inside a replica. num_tokens: KV tokens held (the
    # routers' measure of load), counted in whole blocks as they are allocated.
    return [{"dp_rank": 0, "num_reqs": num_running + num_waiting, "num_waiting_reqs": num_waiting,
             "num_tokens": kv_blocks_used * block_size}]


def install_load_route(app: FastAPI) -> None:
    @app.get("/get_load", include_in_schema=False)
    async def get_load(request: Request) -> list[dict[str, int]]:
        ctx = get_context(request)
        stats = ctx.metrics.last_stats
        return load_report(stats.num_running, stats.num_waiting, stats.kv_blocks_used, ctx.info.block_size)
