"""The front end's side of the engine: per-request streams over one EngineClient.

The client delivers one StepOutput per engine step on the event loop; `_route` hands each request's delta
to its stream there. Detokenization and stop strings then run in the stream's consumer (the output
processor), never in the engine.

It also decides what gets in (the queue bound and request budgets, server/admission.py, after the
ModelInfo checks at the door), when a request has run too long (--request-timeout), when a live engine
counts as stuck (--engine-stall-timeout), how a shutdown drains, and what happens when the engine dies.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.lora.request import LoRARequest
from engine.messages import AddRequest, LoRAControl, StepOutput
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from server.admission import AdmissionControl, check_budget, default_queue_len
from server.dashboard.observer import StepObserver
from server.engine_client import EngineClient
from server.generation import Expired, GenerationError, GenerationStream
from server.metrics import ServerMetrics

logger = logging.getLogger("pagedserve.server")

_WATCH_INTERVAL_S = 0.25
_DRAIN_POLL_S = 0.05
# After the engine dies, /health answers 503 this long before the exit callback runs, so that load
# balancers and the clients being failed see the error rather than a refused connection.
DEATH_EXIT_DELAY_S = 1.0


class EngineUnavailable(Exception):
    """The engine is not running (shutting down, dead or stuck); the server answers 503."""


@dataclass
class _Route:
    stream: GenerationStream
    prompt_index: int


class AsyncEngine:
    """Hands out GenerationStreams over the EngineClient; keeps /metrics' engine gauges current."""

    def __init__(self, client: EngineClient, tokenizer, metrics: ServerMetrics, stream_interval: int = 1,
                 max_queue_len: int | None = None, request_timeout: float | None = None,
                 stall_timeout: float | None = None) -> None:
        for name, value in (("request_timeout", request_timeout), ("stall_timeout", stall_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}.")
        self.client = client
        self.info = client.info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.admission = AdmissionControl(max_queue_len or default_queue_len(self.info.max_num_seqs))
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self._routes: dict[str, _Route] = {}
        self._controls: dict[str, asyncio.Future[RequestDelta]] = {}    # LoRA loads/unloads awaiting the engine
        self._num_running = 0                    # engine requests running, as of the last step
        self._last_progress = time.monotonic()   # the last step output, or when work arrived at an idle engine
        self._watchdog: asyncio.Task | None = None
        self._stopping = False
        self.engine_dead = False
        self.stalled = False
        self.death_reason: str | None = None
        # Called (on the event loop) once the engine has died: the CLI makes the process exit.
        self.on_engine_death: Callable[[], None] | None = None
        self.observer: StepObserver | None = None     # the dashboard's stats (server/dashboard/collector.py)

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.client.start(self._route, self._engine_died)
        self._watchdog = asyncio.create_task(self._watch())

    async def drain(self, timeout: float, force: Callable[[], bool] = lambda: False) -> None:
        """Shutdown has begun: refuse new requests now (503, /health 503); give the open ones `timeout`
        seconds (or until `force()`), then end those still running with finish_reason "abort"."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._routes and time.monotonic() < deadline and not force() and not self.engine_dead:
            await asyncio.sleep(_DRAIN_POLL_S)
        streams = self._open_streams()
        if streams and not self.engine_dead:
            logger.warning("drain timeout: aborting %d request(s) still running", len(streams))
        for stream in streams:
            stream.put(Expired("shutdown"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._fail_all("the server is shutting down", 503)
        await self.client.shutdown(timeout)

    @property
    def alive(self) -> bool:
        return not self._stopping and self.client.alive and not self.stalled

    @property
    def unavailable_reason(self) -> str:
        if self.engine_dead or (not self._stopping and not self.client.alive):
            return "the engine stopped after an internal error"
        if self.stalled:
            return f"the engine has completed no step for over {self.stall_timeout:g} s"
        return "the server is shutting down"

    @property
    def num_open_requests(self) -> int:
        return len(self._routes)

    @property
    def num_waiting(self) -> int:
        """Engine requests submitted and not running: in the engine's queue, or on their way to it."""
        return max(0, len(self._routes) - self._num_running)

    def _open_streams(self) -> list[GenerationStream]:
        return list({id(r.stream): r.stream for r in self._routes.values()}.values())

    def _engine_died(self, reason: str) -> None:
        """The client saw the engine die: fail every open request now, then let the process exit."""
        self.engine_dead = True
        self.death_reason = reason
        self._fail_all("the engine stopped unexpectedly")
        if self.on_engine_death is not None:
            asyncio.get_running_loop().call_later(DEATH_EXIT_DELAY_S, self.on_engine_death)

    async def _watch(self) -> None:
        """Fails requests that slip in while the engine is dead, and flags an engine that is alive but
        stuck: work pending and no step for --engine-stall-timeout seconds (/health 503, logged)."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self.engine_dead:
                self._fail_all("the engine stopped unexpectedly")
            elif self.stall_timeout is not None:
                quiet = time.monotonic() - self._last_progress
                if self._routes and quiet > self.stall_timeout and not self.stalled:
                    self.stalled = True
                    logger.error("the engine looks stuck: %d request(s) pending and no step completed for "
                                 "%.1f s (--engine-stall-timeout %g)", len(self._routes), quiet, self.stall_timeout)

    def _fail_all(self, message: str, status: int = 500) -> None:
        for stream in self._open_streams():
            stream.put(GenerationError(message, status))
        for future in self._controls.values():
            if not future.done():
                future.set_exception(EngineUnavailable(message))
        self._controls.clear()

    # --- engine -> streams (on the event loop) ------------------------------------------------------
    def _route(self, output: StepOutput) -> None:
        now = time.monotonic()
        self.metrics.flush()        # the previous step's tokens, consumed since
        self._last_progress = now
        if self.stalled:
            self.stalled = False
            logger.warning("the engine completed a step again; no longer stuck")
        self.metrics.observe_stats(output.stats)
        if self.observer is not None:
            self.observer.on_step(output, now)
        self._num_running = output.stats.num_running
        routes = self._routes
        for delta in output.deltas:
            route = routes.get(delta.request_id)
            if route is not None:   # None: the client has gone and the request was aborted
                route.stream.put((route.prompt_index, delta, now))
            elif delta.request_id in self._controls:
                future = self._controls.pop(delta.request_id)
                if not future.done():
                    future.set_result(delta)

    # --- requests --------------------------------------------------------------------------------------
    async def control_lora(self, control: LoRAControl) -> str | None:
        """Loads or unloads an adapter in the engine; the engine's error (why it refused) or None."""
        if not self.alive:
            raise EngineUnavailable(self.unavailable_reason)
        future = asyncio.get_running_loop().create_future()
        self._controls[control.request_id] = future
        self.client.control_lora(control)
        return (await future).error

    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 arrival_time: float | None = None, lora: LoRARequest | None = None) -> GenerationStream:
        """The door: checks every prompt (ValueError -> 400, nothing submitted), then whether the queue has
        room (Overloaded -> 429), then submits them all."""
        if not self.alive:
            raise EngineUnavailable(self.unavailable_reason)
        info = self.info
        for prompt in prompts:
            info.check_request(prompt, params)
        check_budget(params, len(prompts))
        self.admission.admit(self.num_waiting, len(prompts))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = GenerationStream(ids, prompts, params, self.tokenizer, self.metrics,
                                  abort=self.client.abort, release=self._release,
                                  stream_interval=self.stream_interval)
        if not self._routes:
            self._last_progress = time.monotonic()      # an idle engine owes no step until now
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            self._routes[rid] = _Route(stream, i)
            self.client.add(AddRequest(rid, prompt, params, arrival, lora))   # encoded: the engine gets its own copy
            if self.observer is not None:
                self.observer.on_submit(rid, prompt, arrival)
        if self.request_timeout is not None:
            delay = max(0.0, self.request_timeout - (time.monotonic() - arrival))
            stream.deadline = asyncio.get_running_loop().call_later(delay, stream.put, Expired("timeout"))
        return stream

    def _release(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if self.observer is not None and route is not None:
            req = route.stream.requests[route.prompt_index]
            self.observer.on_release(request_id, time.monotonic(), req.last_finish_reason if req.finished else None)
