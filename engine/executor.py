"""Runs the device half of a step (forward + sampling) inline or on a worker thread.

With overlap on, the engine thread launches step N+1 (schedule, build inputs, host->device copy)
while step N still runs; tokens of step N that step N+1 consumes are placeholders on the host and
are filled in on the device from step N's sampled-token tensor, so nothing waits for the host copy.
The worker runs tasks in launch order, so step N is complete when step N+1's task begins.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.distributed.step_channel import StepChannel
from engine.model_runner import ModelRunner, StepInputs
from engine.outputs import StepStats
from engine.pooling import PoolChunk
from engine.request import Sequence
from engine.sampler import Sampler, SamplerOutput, SamplingTensors, score_tokens
from engine.scheduler import SchedulerOutput
from engine.spec_decode.rejection import verify_drafts

PLACEHOLDER = -1  # a token id that is still being sampled on the device


LogprobLists = tuple[list[float], list[int], list[list[int]], list[list[float]]]   # logprobs, ranks, top ids, top


@dataclass
class StepResult:
    token_ids: torch.Tensor                  # [num_rows] on the device: feeds the next step's placeholders
    tokens: list[int]
    logprobs: LogprobLists | None
    forward_s: float
    sample_s: float
    prompt_logprobs: LogprobLists | None = None   # one row per scored prompt position, in launch order
    pooled: torch.Tensor | None = None       # [num pooled chunks, hidden] fp32 on the device (embeddings)


@dataclass
class LaunchedStep:
    sched: SchedulerOutput
    rows: list[Sequence]                     # one per sampled token, in row order
    positions: list[int]                     # where each row's token goes in its sequence
    scored: list[tuple[Sequence, range]]     # prompt_logprobs: the positions each sequence scores, in order
    future: Future
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    step: StepStats | None = None            # what the step computes, for the engine's stats
    scored_only: list[Sequence] = field(default_factory=list)   # max_tokens 0: prompts it completes
    pool: list[PoolChunk] = field(default_factory=list)         # embedding requests' chunks, in batch order
    spec: list[tuple[Sequence, int]] = field(default_factory=list)   # sequences verifying drafts, and how many


@dataclass
class StepTask:
    inputs: StepInputs
    block_copies: list[tuple[int, int]]
    prev: Future | None                      # the previous step, whose sampled tokens fill the placeholders
    counts: torch.Tensor | None              # rows per sampled sequence (n > 1 forks repeat a row)
    sampling: SamplingTensors | None
    prompt_logprobs: int | None = None       # alternatives to return for scored prompt positions (None: none)


class StepExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, overlap: bool, sync_cuda: bool,
                 channel: StepChannel | None = None,
                 mirror: Callable[[StepInputs, list[tuple[int, int]]], None] | None = None) -> None:
        """channel: tensor parallelism's link to the other ranks, which run the same forward; mirror: runs each
        step through the draft model too (speculative decoding's draft_model, engine/spec_decode)."""
        self.runner, self.sampler, self.channel, self.mirror = runner, sampler, channel, mirror
        self.sync_cuda = sync_cuda
        device = runner.device
        # The current CUDA device is per thread: the worker must use the engine's.
        init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step", initializer=init) if overlap else None

    def submit(self, task: StepTask) -> Future:
        if self.pool is not None:
            return self.pool.submit(self.run, task)
        future: Future = Future()
        try:
            future.set_result(self.run(task))
        except Exception as e:
            future.set_exception(e)
        return future

    @torch.inference_mode()
    def run(self, task: StepTask) -> StepResult:
        t0 = time.perf_counter()
        if self.channel is not None:
            self.channel.send_step(task.inputs.packed, task.block_copies)
        self.runner.copy_blocks(task.block_copies)
        if task.inputs.fill_dst is not None:
            task.inputs.input_ids[task.inputs.fill_dst] = self._previous_tokens(task)
        logits = self.runner.forward(task.inputs)
        if self.mirror is not None:
            self.mirror(task.inputs, task.block_copies)
        if self.sync_cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        prompt_logprobs = None
        if task.prompt_logprobs is not None:
            num_sampling = task.inputs.logits_indices.shape[0]
            scored = score_tokens(logits[num_sampling:], task.inputs.prompt_target_ids, task.prompt_logprobs)
            prompt_logprobs, logits = _lists(scored), logits[:num_sampling]
        pooled = task.inputs.pooled
        if task.sampling is None:
            return StepResult(torch.empty(0, dtype=torch.long), [], None, t1 - t0, 0.0, prompt_logprobs, pooled)
        if task.counts is not None:
            logits = logits.repeat_interleave(task.counts, dim=0)
        out = self.sampler.sample(logits, task.sampling,
                                  pick=None if task.sampling.drafts is None else self._verify)
        tokens = out.token_ids.tolist()  # the one device->host copy of the step
        logprobs = _lists(out) if out.logprobs is not None else None
        return StepResult(out.token_ids, tokens, logprobs, t1 - t0, time.perf_counter() - t1, prompt_logprobs,
                          pooled)

    def _verify(self, x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        return verify_drafts(self.sampler, x, st)

    @staticmethod
    def _previous_tokens(task: StepTask) -> torch.Tensor:
        if task.prev.exception() is not None:
            # The previous step failed and its sequences are being failed: their rows here are discarded.
            return torch.zeros_like(task.inputs.fill_dst)
        return task.prev.result().token_ids[task.inputs.fill_src].to(torch.int32)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _lists(out: SamplerOutput) -> LogprobLists:
    no_top = [[] for _ in range(out.logprobs.shape[0])]   # k = 0: the chosen token only
    return (out.logprobs.tolist(), out.ranks.tolist(),
            no_top if out.top_ids is None else out.top_ids.tolist(),
            no_top if out.top_logprobs is None else out.top_logprobs.tolist())
