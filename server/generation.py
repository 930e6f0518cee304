"""One HTTP request's generation, as the event loop sees it: the output processor's choices, usage, metrics.

A request with P prompts and n samples each is P engine requests; its choices are numbered
prompt_index * n + sample_index. Each engine request's deltas go through the one output processor
(engine/output_processor.py: text, stop strings, logprobs, finish) that the offline API uses too.
Deltas land in one inbox per HTTP request; each wake-up drains everything there, so a slow client gets
fewer, bigger updates instead of falling behind.

`stream_interval` (SGLang's knob of that name) wakes the consumer only every that many engine steps, or at
once for the first token, a finish or an error: bigger chunks, less per-chunk work, for throughput.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.output_processor import Choice, ChoiceDelta, RequestProcessor
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from server.metrics import RequestRecorder, ServerMetrics, current_endpoint

__all__ = ["ChoiceDelta", "Expired", "GenerationError", "GenerationStream"]


class GenerationError(Exception):
    """The request cannot finish (engine failure, engine death, shutdown); the client gets `status`, or an
    in-band error event when its stream has already started."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Expired:
    """Ends a stream now: its unfinished choices finish with "abort" (--request-timeout, end of a drain)."""
    why: str        # "timeout" | "shutdown"


# Engine -> stream messages: (prompt_index, delta, deliver time), a GenerationError when the engine died,
# or Expired when the server ends the request.
QueueItem = tuple[int, RequestDelta, float] | GenerationError | Expired
AbortFn = Callable[[str, int | None, str], None]


class GenerationStream:
    def __init__(self, request_ids: list[str], prompts: list[list[int]], params: SamplingParams,
                 tokenizer, metrics: ServerMetrics, abort: AbortFn, release: Callable[[str], None],
                 stream_interval: int = 1) -> None:
        self.params = params
        self.model = ""         # the name its responses carry: the served model's or its LoRA adapter's
        self._inbox: list[QueueItem] = []
        self._ready = False                      # the inbox holds something worth waking up for
        self._waiter: asyncio.Future | None = None
        self._interval = stream_interval
        self._woken = False                      # woken at least once (the first token is never held)
        n = params.n
        self.requests = [RequestProcessor(rid, ids, params, tokenizer, first_index=p * n)
                         for p, (rid, ids) in enumerate(zip(request_ids, prompts))]
        endpoint = current_endpoint.get()
        metrics.count_endpoint_request(endpoint)
        self.recorders = [RequestRecorder(metrics, endpoint) for _ in request_ids]
        self.choices: list[Choice] = [c for req in self.requests for c in req.choices]
        self._cached = [0] * len(self.requests)       # prompt tokens each request found in the prefix cache
        self._abort = abort
        self._release = release
        self._closed = False
        self.expired: str | None = None                   # Expired.why, once it ended the stream
        self.deadline: asyncio.TimerHandle | None = None  # --request-timeout's timer, cancelled on close
        self.push: Callable[[], None] | None = None        # told when news is ready (server/stream_response.py)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, as the engine reported them so far."""
        return sum(self._cached)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def finished(self) -> bool:
        for req in self.requests:      # a loop, not all(<genexpr>): this runs once per token
            if not req.finished:
                return False
        return True

    @property
    def ready(self) -> bool:
        """The inbox holds news worth taking now (see stream_interval)."""
        return self._ready

    def put(self, item: QueueItem) -> None:
        """Called on the event loop by the bridge: one item per engine step with news for this stream.
        The consumer learns of news through `push` when set (a streamed response), else by its waiter."""
        self._inbox.append(item)
        if not self._ready and self._wakes(item):
            self._ready = True
            if self.push is not None:
                self.push()
                return
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _wakes(self, item: QueueItem) -> bool:
        if self._interval <= 1 or not self._woken or len(self._inbox) >= self._interval:
            return True
        if isinstance(item, (GenerationError, Expired)):
            return True
        delta = item[1]
        return delta.finished or delta.error is not None or any(s.finish_reason for s in delta.seqs)

    async def first_news(self) -> GenerationError | None:
        """Waits for the engine's first word on this stream without consuming it; returns the error it
        reports when the request was refused there (e.g. a grammar that failed to compile)."""
        if not self._inbox:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._inbox[0]
        if isinstance(item, GenerationError):
            return item
        if isinstance(item, tuple) and item[1].error is not None:
            return GenerationError(item[1].error, item[1].error_status)
        return None

    def take(self) -> list[ChoiceDelta]:
        """The choices' news since the last take (possibly none). Raises GenerationError when the request
        failed, after counting it in /metrics. A streamed response takes when `push` says there is news
        (server/stream_response.py); `updates()` when its waiter is woken."""
        items, self._inbox = self._inbox, []
        self._ready, self._woken = False, True
        try:
            return self._apply(items)
        except GenerationError:
            self._record_failure()
            raise

    async def updates(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yields the choices' news, in batches, until every choice has finished."""
        try:
            while not self.finished:
                if not self._ready:
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                deltas = self.take()
                if deltas:
                    yield deltas
        finally:
            self.close()

    def _record_failure(self) -> None:
        """The request failed: /metrics counts its unfinished parts as "error" (close() then aborts them in
        the engine without counting them again)."""
        now = time.monotonic()
        for req, recorder in zip(self.requests, self.recorders):
            if not req.finished or req.error is not None:
                recorder.on_finish("error", None, len(req.prompt_token_ids), now)

    async def collect(self) -> None:
        """Runs to the end (non-streaming requests)."""
        async for _ in self.updates():
            pass

    def close(self) -> None:
        """Aborts whatever the engine is still generating for this stream (client gone, error, ...)."""
        if self._closed:
            return
        self._closed = True
        if self.deadline is not None:
            self.deadline.cancel()
        for req, recorder in zip(self.requests, self.recorders):
            self._release(req.request_id)
            if not req.finished:
                req.finished = True
                self._abort(req.request_id, None, "abort")
                recorder.on_finish("abort", None, len(req.prompt_token_ids), 0.0)

    def _apply(self, items: list[QueueItem]) -> list[ChoiceDelta]:
        merged: dict[int, ChoiceDelta] = {}
        for item in items:
            if type(item) is not tuple:
                if isinstance(item, GenerationError):
                    raise item
                self._expire(item.why, merged)
                continue
            prompt_index, delta, now = item
            req = self.requests[prompt_index]
            if req.finished:
                continue    # tokens still in flight after we stopped every sample ourselves
            self._cached[prompt_index] = max(self._cached[prompt_index], delta.num_cached_tokens)
            num_new = 0
            for choice_delta in req.process(delta):
                num_new += len(choice_delta.token_ids)
                _merge(merged, choice_delta)
            if req.error is not None:
                self._release(req.request_id)
                raise GenerationError(req.error, req.error_status)
            if req.stopped_samples:
                for index in req.stopped_samples:    # the engine does not know about stop strings
                    self._abort(req.request_id, index, "stop")
                req.stopped_samples.clear()
            recorder = self.recorders[prompt_index]
            recorder.on_delta(delta.timings, delta.num_prompt_tokens, num_new, now)
            if req.finished:
                self._release(req.request_id)
                recorder.on_finish(req.last_finish_reason, delta.timings, delta.num_prompt_tokens, now)
        if len(merged) <= 1:
            return list(merged.values())
        return [merged[i] for i in sorted(merged)]

    def _expire(self, why: str, merged: dict[int, ChoiceDelta]) -> None:
        """Finishes every unfinished choice with "abort" and tells the engine to stop."""
        self.expired = why
        now = time.monotonic()
        for req, recorder in zip(self.requests, self.recorders):
            if req.finished:
                continue
            for choice_delta in req.expire():
                _merge(merged, choice_delta)
            self._release(req.request_id)
            self._abort(req.request_id, None, "abort")
            recorder.on_finish("abort", None, len(req.prompt_token_ids), now)


def _merge(merged: dict[int, ChoiceDelta], d: ChoiceDelta) -> None:
    prev = merged.get(d.index)
    if prev is None:
        merged[d.index] = d
        return
    prev.text += d.text
    prev.token_ids = prev.token_ids + d.token_ids
    if d.logprobs is not None:
        prev.logprobs = (prev.logprobs or []) + d.logprobs
    prev.finish_reason, prev.stop_reason = d.finish_reason, d.stop_reason
