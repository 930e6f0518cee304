"""Per-request timelines of the most recent requests, from the step messages the front end receives.

Per step this touches each request named in the step once (never each token): its new-token count, its
engine timestamps, and the step's prefill chunks and preemptions. Token ids are kept only when the operator
asked to see prompts and outputs (--dashboard-show-prompts).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.messages import StepOutput

MAX_EVENTS = 64          # prefill chunks / preemptions kept per request (a long prompt in small chunks)


@dataclass
class Timeline:
    request_id: str
    arrival: float                               # time.monotonic(), like every time here
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)      # (time, tokens) of each prefill chunk
    preemptions: list[float] = field(default_factory=list)
    output_token_ids: list[int] | None = None    # sample 0's, when kept

    def state(self) -> str:
        if self.finished is not None:
            return "finished"
        if self.first_token is not None:
            return "decode"
        return "prefill" if self.chunks else "queued"

    def to_json(self, now: float, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - self.arrival, 6)

        out: dict[str, Any] = {
            "id": self.request_id, "state": self.state(), "age_s": round(now - self.arrival, 3),
            "queued_s": rel(self.first_scheduled), "first_token_s": rel(self.first_token),
            "finished_s": rel(self.finished), "finish_reason": self.finish_reason,
            "prompt_tokens": self.num_prompt_tokens, "cached_tokens": self.num_cached_tokens,
            "output_tokens": self.num_output_tokens,
            "prefill_chunks": [[rel(t), n] for t, n in self.chunks], "preempted_s": [rel(t) for t in self.preemptions],
        }
        if decode is not None:
            out["prompt"] = decode(self.prompt_token_ids or [])
            out["output"] = decode(self.output_token_ids or [])
        return out


class RequestTimelines:
    def __init__(self, max_recent: int = 32, keep_tokens: bool = False) -> None:
        self.max_recent = max_recent
        self.keep_tokens = keep_tokens
        self.active: dict[str, Timeline] = {}
        self.recent: deque[Timeline] = deque(maxlen=max_recent)

    def on_submit(self, request_id: str, prompt_token_ids: list[int], arrival: float) -> None:
        self.active[request_id] = Timeline(request_id, arrival, len(prompt_token_ids),
                                           list(prompt_token_ids) if self.keep_tokens else None,
                                           output_token_ids=[] if self.keep_tokens else None)

    def on_step(self, output: StepOutput, now: float) -> None:
        active = self.active
        step = output.stats.step
        if step is not None:
            for request_id, tokens in step.prefill_chunks:
                t = active.get(request_id)
                if t is not None and len(t.chunks) < MAX_EVENTS:
                    t.chunks.append((now, tokens))
            for request_id in step.preempted:
                t = active.get(request_id)
                if t is not None and len(t.preemptions) < MAX_EVENTS:
                    t.preemptions.append(now)
        for delta in output.deltas:
            t = active.get(delta.request_id)
            if t is None:
                continue
            if t.first_token is None:      # the timestamps settle once the first token exists
                timings = delta.timings
                t.first_scheduled, t.first_token = timings.first_scheduled_time, timings.first_token_time
                t.num_cached_tokens = delta.num_cached_tokens
            for seq in delta.seqs:
                t.num_output_tokens += len(seq.new_token_ids)
                if t.output_token_ids is not None and seq.index == 0:
                    t.output_token_ids.extend(seq.new_token_ids)
            if delta.finished:
                reasons = sorted({s.finish_reason for s in delta.seqs if s.finish_reason})
                self._finish(t, delta.timings.finished_time or now, ",".join(reasons) or None)

    def on_release(self, request_id: str, now: float, finish_reason: str | None) -> None:
        """The front end let go of the request. If the engine never said it finished, the front end ended it:
        a stop string (finish_reason "stop"), or an abort (None: the client left, a timeout)."""
        t = self.active.get(request_id)
        if t is not None:
            self._finish(t, now, finish_reason or "abort")

    def _finish(self, t: Timeline, when: float, reason: str | None) -> None:
        t.finished, t.finish_reason = when, reason
        self.active.pop(t.request_id, None)
        self.recent.append(t)

    def latest(self) -> list[Timeline]:
        """The most recent max_recent requests, running or finished, newest first."""
        everyone = list(self.active.values()) + list(self.recent)
        everyone.sort(key=lambda t: t.arrival, reverse=True)
        return everyone[:self.max_recent]
