"""Request and Sequence state, owned by the engine thread."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.lora.request import LoRARequest
from engine.outputs import RequestTimings, TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.executor import LogprobLists
    from engine.spec_decode.proposer import SpecState
    from engine.structured.compiler import PendingGrammar
    from engine.structured.matcher import SeqMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                    # params.max_tokens resolved against max_model_len
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(time.monotonic()))
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    grammar: PendingGrammar | None = None   # set while its structured-output grammar compiles
    # prompt_logprobs: entry p scores prompt token p + 1 (position p's logits); sent once all are in.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    pooling: str | None = None         # an embedding request's pooling type ("last" | "mean"), else None
    lora: LoRARequest | None = None    # the adapter it runs with (None: the base model)

    @property
    def lora_id(self) -> int:
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def cache_salt(self) -> bytes | None:
        """Where its prefix-cache hash chain starts: KV differs per adapter, so blocks are keyed by it."""
        if self.lora is None:
            return None
        return f"lora:{self.lora.lora_int_id}:{self.lora.lora_path}".encode()

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs) and len(self.seqs) == self.params.n


@dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt + generated tokens, and where their KV lives."""
    seq_id: int
    request: Request
    index: int                         # sample index 0..n-1
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0       # tokens whose KV is in the cache
    num_hashed_blocks: int = 0         # leading full blocks already registered in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)
    needs_fork: bool = False           # first sample of an n > 1 request, prompt not yet prefilled
    pending_row: int = -1              # row of its token in the latest launched step (overlap)
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[TokenLogprob] | None = None
    matcher: SeqMatcher | None = None  # its grammar's state (constrained requests only)
    # Speculative decoding: draft tokens to verify in the next step (never part of token_ids), and backoff
    spec_token_ids: list[int] = field(default_factory=list)
    spec: SpecState | None = None
    # Mean pooling over chunked prefill: the sum of the final hidden states of positions [0, num_pooled)
    pooled_sum: torch.Tensor | None = None
    num_pooled: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def prompt_logprob_positions(self, num_new_tokens: int) -> range:
        """Positions of its next chunk whose logits score a prompt token not scored yet (the first sample
        scores the prompt for the whole request; after a preemption, scored positions are not redone)."""
        scored = self.request.prompt_logprobs
        if scored is None or self.index != 0:
            return range(0)
        start = self.num_computed_tokens
        return range(max(start, len(scored)), min(start + num_new_tokens, self.num_prompt_tokens - 1))

    @property
    def num_reusable_tokens(self) -> int:
        """Leading tokens whose KV may come from the prefix cache: a cached prefix has no logits or hidden
        states, so not the positions whose prompt logprobs are still wanted, nor any for mean pooling (last
        pooling needs only the last token's, which is always computed)."""
        if self.request.pooling == "mean":   # every position's hidden state is pooled: none may be skipped
            return 0
        scored = self.request.prompt_logprobs
        if scored is None or self.index != 0 or len(scored) >= self.num_prompt_tokens - 1:
            return self.num_tokens
        return len(scored)


def collect_prompt_logprobs(scored: list[tuple[Sequence, range]], lists: LogprobLists) -> None:
    """Appends each scored position's entry to its request (positions scored twice, around a preemption
    while the step ran, are kept once)."""
    logprobs, ranks, top_ids, top_logprobs = lists
    row = 0
    for seq, span in scored:
        entries, k = seq.request.prompt_logprobs, seq.params.prompt_logprobs
        for pos in span:
            if len(entries) == pos and seq.status is not SeqStatus.FINISHED:
                entries.append(TokenLogprob(seq.token_ids[pos + 1], logprobs[row], ranks[row],
                                            list(zip(top_ids[row][:k], top_logprobs[row][:k]))))
            row += 1
