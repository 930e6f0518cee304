"""The bridge between asyncio and the one engine thread.

The engine thread calls `deliver(deltas, stats)` once per step; that hops to the event loop with a single
`call_soon_threadsafe` and the deltas are routed to the per-request streams there. Detokenization and stop
strings then run in the event loop (server/generation.py), never in the engine thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.outputs import EngineStats, RequestDelta
from engine.sampling_params import SamplingParams
from server.generation import GenerationError, GenerationStream
from server.metrics import ServerMetrics

logger = logging.getLogger("pagedserve.server")

Deliver = Callable[[list[RequestDelta], EngineStats], None]
LoopFactory = Callable[[Any, Deliver], Any]
_WATCH_INTERVAL_S = 0.5


class EngineUnavailable(Exception):
    """The engine thread is not running (shutting down, or it died); the server answers 503."""


@dataclass
class _Route:
    stream: GenerationStream
    prompt_index: int


def _default_loop_factory(engine: Any, deliver: Deliver) -> Any:
    from engine.engine import EngineLoop
    return EngineLoop(engine, deliver)


class AsyncEngine:
    """Owns the EngineLoop; hands out GenerationStreams; keeps /metrics' engine gauges current."""

    def __init__(self, engine: Any, metrics: ServerMetrics, loop_factory: LoopFactory | None = None,
                 stream_interval: int = 1) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._engine_loop = (loop_factory or _default_loop_factory)(engine, self._deliver)
        self._routes: dict[str, _Route] = {}
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None
        self._stopping = False

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._engine_loop.start()
        self._watchdog = asyncio.create_task(self._watch())

    def drain(self, grace_s: float | None) -> None:
        """Shutdown has begun: refuse new requests now; those running get `grace_s` seconds to finish,
        then end with a 503 (or an error event in their stream). None: no deadline."""
        self._stopping = True
        if grace_s is not None:
            asyncio.get_running_loop().call_later(grace_s, self._fail_all, "the server is shutting down", 503)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._fail_all("the server is shutting down", 503)
        await asyncio.to_thread(self._engine_loop.shutdown, timeout)

    @property
    def alive(self) -> bool:
        return not self._stopping and self._engine_loop.alive

    @property
    def num_open_requests(self) -> int:
        return len(self._routes)

    async def _watch(self) -> None:
        """If the engine thread dies, fail every waiting request instead of letting it hang (and keep
        doing so, for a request that slipped in while it was dying)."""
        while self._engine_loop.alive:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        logger.error("the engine thread stopped: %r", getattr(self._engine_loop, "error", None))
        while True:
            self._fail_all("the engine stopped unexpectedly")
            await asyncio.sleep(_WATCH_INTERVAL_S)

    def _fail_all(self, message: str, status: int = 500) -> None:
        for route in list(self._routes.values()):
            route.stream.put(GenerationError(message, status))

    # --- engine thread -> event loop ---------------------------------------------------------------
    def _deliver(self, deltas: list[RequestDelta], stats: EngineStats) -> None:
        """Runs in the engine thread: one hop to the event loop per step."""
        loop = self._event_loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._route, deltas, stats, time.monotonic())
        except RuntimeError:
            pass    # the event loop closed while the engine was finishing its last step

    def _route(self, deltas: list[RequestDelta], stats: EngineStats, now: float) -> None:
        self.metrics.observe_stats(stats)
        routes = self._routes
        for delta in deltas:
            route = routes.get(delta.request_id)
            if route is not None:   # None: the client has gone and the request was aborted
                route.stream.put((route.prompt_index, delta, now))

    # --- requests --------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 arrival_time: float | None = None) -> GenerationStream:
        """Checks every prompt first (ValueError -> 400, nothing submitted), then submits them all."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        for prompt in prompts:
            self.engine.check_request(prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = GenerationStream(ids, prompts, params, self.engine.tokenizer, self.metrics,
                                  abort=self._engine_loop.abort, release=self._release,
                                  stream_interval=self.stream_interval)
        try:
            for i, (rid, prompt) in enumerate(zip(ids, prompts)):
                self._routes[rid] = _Route(stream, i)
                # Each engine request gets its own params: the engine fills in per-request fields.
                self._engine_loop.add_request(rid, prompt, dataclasses.replace(params), arrival)
        except BaseException:
            stream.close()
            raise
        return stream

    def _release(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
