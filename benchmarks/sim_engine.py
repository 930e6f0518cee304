"""A simulated engine for front-end benchmarks: each step takes a fixed time of the device's with the GIL
released (as a GPU step does, the host waiting on the device) and gives every running request one token.

Sized by default like an H100's decode step for Qwen3-0.6B at batch 256: 8 ms per step for up to 256
requests, i.e. 32,000 tokens/s. The tokens cycle through an English sentence, so the front end detokenizes
real text. It runs in the engine process like the real engine (benchmarks/frontend_capacity.py).
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.default_model import resolve
from engine.loader import load_tokenizer
from engine.model_info import ModelInfo, TokenizerSource
from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta
from engine.sampling_params import SamplingParams

STEP_MS_ENV = "PAGEDSERVE_SIM_STEP_MS"
_TEXT = " The quick brown fox jumps over the lazy dog, and then it runs back home before the night falls."


@dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    timings: RequestTimings
    generated: int = 0


class SimEngine:
    def __init__(self, config: EngineConfig) -> None:
        path = resolve("tiny-random").path
        tokenizer = load_tokenizer(path)
        self.step_s = float(os.environ.get(STEP_MS_ENV, "8")) / 1000
        self.max_num_seqs = config.max_num_seqs
        max_model_len = config.max_model_len or 4096
        self.info = ModelInfo("sim", max_model_len, len(tokenizer), (), 1 + 256 * max_model_len // 16 + 1, 16,
                              config.max_num_seqs, TokenizerSource.of(path))
        self.tokens = tokenizer.encode(_TEXT, add_special_tokens=False)
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.num_steps = 0
        self._device_free_at = 0.0      # when the device finishes the step it is running

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora: object = None) -> None:
        if lora is not None:
            self.add_lora(lora)
        max_tokens = params.max_tokens or self.info.max_model_len - len(prompt_token_ids)
        self.waiting.append(_Request(request_id, len(prompt_token_ids), max_tokens,
                                     RequestTimings(arrival_time or time.monotonic())))

    def add_lora(self, lora: object) -> None:
        raise ValueError("the simulated engine serves no LoRA adapters.")

    def remove_lora(self, lora_int_id: int) -> None:
        raise ValueError("the simulated engine serves no LoRA adapters.")

    def abort_request(self, request_id: str, seq_index: int | None = None, finish_reason: str = "abort") -> None:
        self.running.pop(request_id, None)
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[RequestDelta]:
        now = time.monotonic()
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            req.timings.first_scheduled_time = now
            self.running[req.request_id] = req
        # The device's time, with the GIL free meanwhile. The device runs steps back to back while the
        # host keeps ahead of it (the overlap scheduler's case: the host's per-step work, here sending the
        # step's output and reading new requests, runs during the next step's device time), so a step
        # ends one step time after the previous one; after a gap of a whole step (no work, or a host too
        # slow to keep ahead) the device sat idle and the step takes its full time from now.
        start = self._device_free_at if self._device_free_at > now - self.step_s else now
        self._device_free_at = start + self.step_s
        time.sleep(max(0.0, self._device_free_at - now))
        now = time.monotonic()
        token = self.tokens[self.num_steps % len(self.tokens)]
        self.num_steps += 1
        deltas = []
        for req in list(self.running.values()):
            req.generated += 1
            if req.timings.first_token_time is None:
                req.timings.first_token_time = now
            done = req.generated >= req.max_tokens
            deltas.append(RequestDelta(req.request_id, [SequenceDelta(0, [token], None, "length" if done else None)],
                                       done, req.num_prompt_tokens, 0, req.timings))
            if done:
                req.timings.finished_time = now
                del self.running[req.request_id]
        return deltas

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), len(self.running) / self.max_num_seqs)

    def fail_all(self, error: BaseException) -> list[RequestDelta]:
        failed = [RequestDelta(r.request_id, [SequenceDelta(0, [], None, "error")], True, r.num_prompt_tokens, 0,
                               r.timings, error=f"internal error: {type(error).__name__}")
                  for r in [*self.running.values(), *self.waiting]]
        self.running.clear()
        self.waiting.clear()
        return failed
