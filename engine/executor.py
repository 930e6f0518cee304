"""Runs the device half of a step (forward + sampling) inline or on a worker thread.

With overlap on, the engine thread launches step N+1 (schedule, build inputs, host->device copy)
while step N still runs; tokens of step N that step N+1 consumes are placeholders on the host and
are filled in on the device from step N's sampled-token tensor, so nothing waits for the host copy.
The worker runs tasks in launch order, so step N is complete when step N+1's task begins.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.distributed.step_channel import StepChannel
from engine.model_runner import ModelRunner, StepInputs
from engine.outputs import StepStats
from engine.request import Sequence
from engine.sampler import Sampler, SamplingTensors
from engine.scheduler import SchedulerOutput

PLACEHOLDER = -1  # a token id that is still being sampled on the device


@dataclass
class StepResult:
    token_ids: torch.Tensor                  # [num_rows] on the device: feeds the next step's placeholders
    tokens: list[int]
    logprobs: tuple | None                   # (logprobs, ranks, top_ids, top_logprobs) as lists
    forward_s: float
    sample_s: float


@dataclass
class LaunchedStep:
    sched: SchedulerOutput
    rows: list[Sequence]                     # one per sampled token, in row order
    positions: list[int]                     # where each row's token goes in its sequence
    future: Future
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    step: StepStats | None = None            # what the step computes, for the engine's stats


@dataclass
class StepTask:
    inputs: StepInputs
    block_copies: list[tuple[int, int]]
    prev: Future | None                      # the previous step, whose sampled tokens fill the placeholders
    counts: torch.Tensor | None              # rows per sampled sequence (n > 1 forks repeat a row)
    sampling: SamplingTensors | None


class StepExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, overlap: bool, sync_cuda: bool,
                 channel: StepChannel | None = None) -> None:
        """channel: tensor parallelism's link to the other ranks, which run the same forward."""
        self.runner, self.sampler, self.channel = runner, sampler, channel
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
        if self.sync_cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if task.sampling is None:
            return StepResult(torch.empty(0, dtype=torch.long), [], None, t1 - t0, 0.0)
        if task.counts is not None:
            logits = logits.repeat_interleave(task.counts, dim=0)
        out = self.sampler.sample(logits, task.sampling)
        tokens = out.token_ids.tolist()  # the one device->host copy of the step
        logprobs = None
        if out.logprobs is not None:
            no_top = [[] for _ in tokens]  # logprobs=0: the chosen token only
            logprobs = (out.logprobs.tolist(), out.ranks.tolist(),
                        no_top if out.top_ids is None else out.top_ids.tolist(),
                        no_top if out.top_logprobs is None else out.top_logprobs.tolist())
        return StepResult(out.token_ids, tokens, logprobs, t1 - t0, time.perf_counter() - t1)

    @staticmethod
    def _previous_tokens(task: StepTask) -> torch.Tensor:
        if task.prev.exception() is not None:
            # The previous step failed and its sequences are being failed: their rows here are discarded.
            return torch.zeros_like(task.inputs.fill_dst)
        return task.prev.result().token_ids[task.inputs.fill_src].to(torch.int32)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
