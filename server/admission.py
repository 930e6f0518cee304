"""What the server lets in: a bounded waiting queue (HTTP 429 beyond it) and per-request budgets (HTTP 400).

SamplingParams already bounds each field (n, logprobs, stop strings, logit_bias) and ModelInfo.check_request
that each prompt with its n samples fits the context and the KV cache. What is left is what only the whole
request shows: how many choices it fans out to.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams

# Choices (prompts x n) of one HTTP request: each costs a detokenizer and a slot in every response.
MAX_CHOICES = 256
DEFAULT_QUEUE_FACTOR = 4      # --max-queue-len defaults to this many times --max-num-seqs
RETRY_AFTER_S = 1


class Overloaded(Exception):
    """The waiting queue is full; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class AdmissionControl:
    """Refuses work that would make more than `max_queue_len` engine requests wait.

    The front end knows how many engine requests it has open; the engine reports after every step how many
    of them run. The rest wait (in the engine's queue or in its inbox). An idle queue always takes one more
    request, however many prompts it carries, so serial clients are never throttled."""
    max_queue_len: int

    def __post_init__(self) -> None:
        if self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {self.max_queue_len}.")

    def admit(self, num_waiting: int, num_new: int) -> None:
        if num_waiting > 0 and num_waiting + num_new > self.max_queue_len:
            raise Overloaded(f"The server is at capacity ({num_waiting} requests are waiting; the queue holds "
                             f"{self.max_queue_len}). Retry later.")


def default_queue_len(max_num_seqs: int) -> int:
    return DEFAULT_QUEUE_FACTOR * max_num_seqs


def check_budget(params: SamplingParams, num_prompts: int) -> None:
    """ValueError (HTTP 400) for a request that fans out to more choices than the server answers at once.
    (Whether its n samples fit the KV cache is ModelInfo.check_request's, per prompt.)"""
    choices = num_prompts * params.n
    if choices > MAX_CHOICES:
        raise ValueError(f"A request may ask for at most {MAX_CHOICES} choices (prompts x n); this one asks for "
                         f"{num_prompts} x {params.n} = {choices}.")
