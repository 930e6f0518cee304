"""One HTTP request's generation, as the event loop sees it: text, stop strings, usage, metrics.

A request with P prompts and n samples each is P engine requests; its choices are numbered
prompt_index * n + sample_index. Deltas from the engine land in one inbox per HTTP request; each wake-up
drains everything there, so a slow client gets fewer, bigger updates instead of falling behind.

`stream_interval` (SGLang's knob of that name) wakes the consumer only every that many engine steps, or at
once for the first token, a finish or an error: bigger chunks, less per-chunk work, for throughput.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestDelta, SequenceDelta, TokenLogprob
from engine.sampling_params import SamplingParams
from server.metrics import RequestRecorder, ServerMetrics


class GenerationError(Exception):
    """The request cannot finish (engine failure, engine death, shutdown); the client gets `status`, or an
    in-band error event when its stream has already started."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ChoiceDelta:
    """What one choice gained in one update."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Choice:
    """Everything one choice has produced so far."""
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    recorder: RequestRecorder
    finished: bool = False
    last_finish_reason: str = "stop"    # the request's outcome is that of its last sample to finish


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
        self._inbox: list[QueueItem] = []
        self._ready = False                      # the inbox holds something worth waking up for
        self._waiter: asyncio.Future | None = None
        self._interval = stream_interval
        self._woken = False                      # woken at least once (the first token is never held)
        self.requests = [EngineRequest(rid, ids, RequestRecorder(metrics)) for rid, ids in zip(request_ids, prompts)]
        want_logprobs = params.logprobs is not None
        self.choices = [
            Choice(p * params.n + i, IncrementalDetokenizer(
                tokenizer, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens),
                logprobs=[] if want_logprobs else None)
            for p, ids in enumerate(prompts) for i in range(params.n)]
        self._abort = abort
        self._release = release
        self._closed = False
        self.expired: str | None = None                   # Expired.why, once it ended the stream
        self.deadline: asyncio.TimerHandle | None = None  # --request-timeout's timer, cancelled on close

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.requests)

    def put(self, item: QueueItem) -> None:
        """Called on the event loop by the bridge: one item per engine step with news for this stream."""
        self._inbox.append(item)
        if not self._ready and self._wakes(item):
            self._ready = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

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

    async def updates(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yields the choices' news, in batches, until every choice has finished."""
        try:
            while not self.finished:
                if not self._ready:
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                items, self._inbox = self._inbox, []
                self._ready, self._woken = False, True
                try:
                    deltas = self._apply(items)
                except GenerationError:
                    self._record_failure()
                    raise
                if deltas:
                    yield deltas
        finally:
            self.close()

    def _record_failure(self) -> None:
        """The request failed: /metrics counts its unfinished parts as "error" (close() then aborts them in
        the engine without counting them again)."""
        now = time.monotonic()
        for req in self.requests:
            if not req.finished:
                req.recorder.on_finish("error", None, len(req.prompt_token_ids), now)

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
        for req in self.requests:
            self._release(req.request_id)
            if not req.finished:
                req.finished = True
                self._abort(req.request_id, None, "abort")
                req.recorder.on_finish("abort", None, len(req.prompt_token_ids), 0.0)

    def _apply(self, items: list[QueueItem]) -> list[ChoiceDelta]:
        merged: dict[int, ChoiceDelta] = {}
        for item in items:
            if isinstance(item, GenerationError):
                raise item
            if isinstance(item, Expired):
                self._expire(item.why, merged)
                continue
            prompt_index, delta, now = item
            req = self.requests[prompt_index]
            if req.finished:
                continue    # tokens still in flight after we stopped every sample ourselves
            if delta.error is not None:
                raise GenerationError(delta.error, delta.error_status)
            num_new, any_finished = 0, delta.finished
            for seq in delta.seqs:
                choice_delta = self._apply_seq(prompt_index, seq, request_done=delta.finished)
                if choice_delta is not None:
                    num_new += len(choice_delta.token_ids)
                    any_finished = any_finished or choice_delta.finish_reason is not None
                    _merge(merged, choice_delta)
            req.recorder.on_delta(delta.timings, delta.num_prompt_tokens, num_new, now)
            if any_finished:
                self._maybe_finish(prompt_index, delta, now)
        return [merged[i] for i in sorted(merged)]

    def _apply_seq(self, prompt_index: int, seq: SequenceDelta, request_done: bool) -> ChoiceDelta | None:
        choice = self.choices[prompt_index * self.params.n + seq.index]
        if choice.finish_reason is not None:
            return None
        if seq.finish_reason == "error":
            raise GenerationError("generation failed inside the engine")
        text, token_ids = self._push(choice, seq.new_token_ids)
        logprobs = seq.new_logprobs[:len(token_ids)] if seq.new_logprobs is not None else None
        if choice.logprobs is not None and logprobs:
            choice.logprobs.extend(logprobs)
        choice.token_ids.extend(token_ids)
        if choice.detok.stopped is not None:
            choice.finish_reason, choice.stop_reason = "stop", choice.detok.stopped
            if seq.finish_reason is None and not request_done:
                # The engine does not know about stop strings: tell it this sample is done.
                self._abort(self.requests[prompt_index].request_id, seq.index, "stop")
        elif seq.finish_reason is not None:
            text += choice.detok.flush()
            choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
        choice.text += text
        if choice.finish_reason is not None:
            self.requests[prompt_index].last_finish_reason = choice.finish_reason
        if not text and not token_ids and choice.finish_reason is None:
            return None
        return ChoiceDelta(choice.index, text, token_ids, logprobs, choice.finish_reason, choice.stop_reason)

    def _push(self, choice: Choice, token_ids: list[int]) -> tuple[str, list[int]]:
        """Feeds the detokenizer; with stop strings, one token at a time, so that tokens after the one
        that completed a stop string are neither returned nor counted."""
        if not self.params.stop or len(token_ids) <= 1:
            return choice.detok.push(token_ids), token_ids
        pieces = []
        for i, tok in enumerate(token_ids):
            pieces.append(choice.detok.push([tok]))
            if choice.detok.stopped is not None:
                return "".join(pieces), token_ids[:i + 1]
        return "".join(pieces), token_ids

    def _maybe_finish(self, prompt_index: int, delta: RequestDelta, now: float) -> None:
        req = self.requests[prompt_index]
        n = self.params.n
        choices = self.choices[prompt_index * n:(prompt_index + 1) * n]
        if not delta.finished and any(c.finish_reason is None for c in choices):
            return
        for c in choices:
            if c.finish_reason is None:     # the engine ended the request without a reason for this sample
                raise GenerationError("the engine finished a request with an unfinished sample")
        req.finished = True
        self._release(req.request_id)
        req.recorder.on_finish(req.last_finish_reason, delta.timings, delta.num_prompt_tokens, now)

    def _expire(self, why: str, merged: dict[int, ChoiceDelta]) -> None:
        """Finishes every unfinished choice with "abort" (text held back for a possible stop string is
        released, as at any finish) and tells the engine to stop."""
        self.expired = why
        n, now = self.params.n, time.monotonic()
        for p, req in enumerate(self.requests):
            if req.finished:
                continue
            for choice in self.choices[p * n:(p + 1) * n]:
                if choice.finish_reason is None:
                    text = choice.detok.flush()
                    choice.text += text
                    choice.finish_reason = "abort"
                    _merge(merged, ChoiceDelta(choice.index, text, [], None, "abort"))
            req.finished = True
            self._release(req.request_id)
            self._abort(req.request_id, None, "abort")
            req.recorder.on_finish("abort", None, len(req.prompt_token_ids), now)


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
