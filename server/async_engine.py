"""The bridge between asyncio and the one engine thread.

The engine thread calls `deliver(deltas, stats)` once per step; that hops to the event loop with a single
`call_soon_threadsafe` and the deltas are routed to the per-request streams there. Detokenization and stop
strings then run in the event loop (server/generation.py), never in the engine thread.

It also decides what gets in (the queue bound, server/admission.py), when a request has run too long
(--request-timeout), how a shutdown drains, and what happens when the engine thread dies.
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
from server.admission import AdmissionControl, check_budget, default_queue_len
from server.generation import Expired, GenerationError, GenerationStream
from server.metrics import ServerMetrics

logger = logging.getLogger("pagedserve.server")

Deliver = Callable[[list[RequestDelta], EngineStats], None]
LoopFactory = Callable[[Any, Deliver], Any]
_WATCH_INTERVAL_S = 0.5
_DRAIN_POLL_S = 0.05
# After the engine thread dies, /health answers 503 this long before the exit callback runs, so that load
# balancers and the clients being failed see the error rather than a refused connection.
DEATH_EXIT_DELAY_S = 1.0


class EngineUnavailable(Exception):
    """The engine thread is not running (shutting down, or it died); the server answers 503."""


@dataclass
class _Route:
    stream: GenerationStream
    prompt_index: int


def _default_loop_factory(engine: Any, deliver: Deliver) -> Any:
    from engine.engine import EngineLoop
    return EngineLoop(engine, deliver)


def _kv_capacity_tokens(engine: Any) -> int | None:
    """Tokens the KV cache holds (block 0 is reserved), when the engine says."""
    blocks, config = getattr(engine, "num_kv_blocks", None), getattr(engine, "config", None)
    if blocks is None or config is None:
        return None
    return (blocks - 1) * config.block_size


class AsyncEngine:
    """Owns the EngineLoop; hands out GenerationStreams; keeps /metrics' engine gauges current."""

    def __init__(self, engine: Any, metrics: ServerMetrics, loop_factory: LoopFactory | None = None,
                 stream_interval: int = 1, max_queue_len: int | None = None,
                 request_timeout: float | None = None) -> None:
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}.")
        self.engine = engine
        self.metrics = metrics
        self.stream_interval = stream_interval
        max_num_seqs = getattr(getattr(engine, "config", None), "max_num_seqs", 64)
        self.admission = AdmissionControl(max_queue_len or default_queue_len(max_num_seqs))
        self.request_timeout = request_timeout
        self.kv_capacity_tokens = _kv_capacity_tokens(engine)
        self._engine_loop = (loop_factory or _default_loop_factory)(engine, self._deliver)
        self._routes: dict[str, _Route] = {}
        self._num_running = 0                    # engine requests running, as of the last step
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None
        self._stopping = False
        self.engine_dead = False
        # Called (on the event loop) once the engine thread has died: the CLI makes the process exit.
        self.on_engine_death: Callable[[], None] | None = None

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._engine_loop.start()
        self._watchdog = asyncio.create_task(self._watch())

    async def drain(self, timeout: float, force: Callable[[], bool] = lambda: False) -> None:
        """Shutdown has begun: refuse new requests now (503, /health 503); give the open ones `timeout`
        seconds (or until `force()`), then end those still running with finish_reason "abort"."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._routes and time.monotonic() < deadline and not force():
            await asyncio.sleep(_DRAIN_POLL_S)
        streams = self._open_streams()
        if streams:
            logger.warning("drain timeout: aborting %d request(s) still running", len(streams))
        for stream in streams:
            stream.put(Expired("shutdown"))

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
    def unavailable_reason(self) -> str:
        if self.engine_dead or (not self._stopping and not self._engine_loop.alive):
            return "the engine stopped after an internal error"
        return "the server is shutting down"

    @property
    def num_open_requests(self) -> int:
        return len(self._routes)

    @property
    def num_waiting(self) -> int:
        """Engine requests submitted and not running: in the engine's queue, or still in its inbox."""
        return max(0, len(self._routes) - self._num_running)

    def _open_streams(self) -> list[GenerationStream]:
        return list({id(r.stream): r.stream for r in self._routes.values()}.values())

    async def _watch(self) -> None:
        """If the engine thread dies, fail every waiting request instead of letting it hang (and keep
        doing so, for a request that slipped in while it was dying), then let the process exit."""
        while self._engine_loop.alive:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        self.engine_dead = True
        logger.error("the engine thread stopped: %r", getattr(self._engine_loop, "error", None))
        if self.on_engine_death is not None:
            asyncio.get_running_loop().call_later(DEATH_EXIT_DELAY_S, self.on_engine_death)
        while True:
            self._fail_all("the engine stopped unexpectedly")
            await asyncio.sleep(_WATCH_INTERVAL_S)

    def _fail_all(self, message: str, status: int = 500) -> None:
        for stream in self._open_streams():
            stream.put(GenerationError(message, status))

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
        self._num_running = stats.num_running
        routes = self._routes
        for delta in deltas:
            route = routes.get(delta.request_id)
            if route is not None:   # None: the client has gone and the request was aborted
                route.stream.put((route.prompt_index, delta, now))

    # --- requests --------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 arrival_time: float | None = None) -> GenerationStream:
        """Checks every prompt first (ValueError -> 400, nothing submitted), then whether the queue has room
        (Overloaded -> 429), then submits them all."""
        if not self.alive:
            raise EngineUnavailable(self.unavailable_reason)
        for prompt in prompts:
            self.engine.check_request(prompt, params)
        check_budget(params, [len(p) for p in prompts], self.engine.max_model_len, self.kv_capacity_tokens)
        self.admission.admit(self.num_waiting, len(prompts))
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
        if self.request_timeout is not None:
            delay = max(0.0, self.request_timeout - (time.monotonic() - arrival))
            stream.deadline = asyncio.get_running_loop().call_later(delay, stream.put, Expired("timeout"))
        return stream

    def _release(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
