"""What the engine hands back each step: plain data, no tensors.

The per-step types are msgspec structs: the engine process sends them to the front end once per step
(engine/messages.py), so they must encode fast and decode into the same types on the other side.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities at one generated position (of the model's raw distribution)."""
    token_id: int
    logprob: float
    rank: int                                     # 1 = most likely
    top: list[tuple[int, float]] = []             # (token_id, logprob), best first


class RequestTimings(msgspec.Struct, array_like=True, gc=False):
    """Monotonic timestamps (time.monotonic(), one clock for every process on the host) of a request."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class SequenceDelta(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one sample (index 0..n-1) of a request in one step."""
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None     # the stop_token_ids entry that ended it (None for eos)


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """One request's news in one engine step; the last one has finished=True."""
    request_id: str
    seqs: list[SequenceDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int             # prompt tokens served from the prefix cache
    timings: RequestTimings
    error: str | None = None           # set when the request failed inside the engine
    error_status: int = 500            # 400 when the request itself was at fault (e.g. its grammar)
    # prompt_logprobs: entry p scores prompt token p + 1; sent once, on the first delta after all are in
    prompt_logprobs: list[TokenLogprob] | None = None
    # An embedding request's L2-normalized vector as little-endian float32 bytes, on its last delta
    embedding: bytes | None = None


class StepStats(msgspec.Struct, array_like=True, gc=False):
    """The step the engine just launched: what it computed and how long the step() call took (with overlap
    that call also waits for the previous batch, so in a steady state it is the step period)."""
    seconds: float
    num_prefill_tokens: int            # prompt (or recomputed) tokens of the chunks in the step
    num_decode_seqs: int               # sequences decoding one token
    num_context_tokens: int            # sum of seq_lens: the KV tokens attention reads
    prefill_chunks: list[tuple[str, int]] = []   # (request_id, tokens) of each prefill chunk
    preempted: list[str] = []          # request ids preempted while scheduling it


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    """Scheduler state after a step, for /metrics and the dashboard."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0        # 0..1, allocated blocks / usable blocks
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0     # prompt tokens found
    grammar_compile_seconds: list[float] = msgspec.field(default_factory=list)   # compiles finished since last stats
    kv_blocks_used: int = 0            # held by requests (the rest of the usable blocks are free)
    kv_blocks_cached: int = 0          # free, but still holding a reusable prefix (evicted last-freed-last)
    step: StepStats | None = None      # None when no step ran (only requests were added or aborted)
    # LoRA adapters (lora_name) with running requests, and those only with waiting ones (--enable-lora)
    running_loras: list[str] = msgspec.field(default_factory=list)
    waiting_loras: list[str] = msgspec.field(default_factory=list)
    # Speculative decoding's running totals (engine/spec_decode/proposer.py SpecCounters)
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_pos_total: list[int] = msgspec.field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None   # vLLM's shape: None for the first token


@dataclass
class EmbeddingOutput:
    embedding: list[float]          # L2-normalized


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result for one prompt (vLLM's shape: `.outputs.embedding`)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class StepTiming:
    """Seconds spent in each phase of one step (recorded when LLMEngine.record_timings is set)."""
    num_seqs: int
    num_tokens: int
    schedule: float
    prepare: float
    forward: float
    sample: float
    postprocess: float
    wait: float = 0.0        # engine thread blocked on the device (overlap hides host work inside it)

    @property
    def host(self) -> float:
        return self.schedule + self.prepare + self.sample + self.postprocess


def add_token(delta: RequestDelta, index: int, tok: int, entry: TokenLogprob | None, finish_reason: str | None,
              stop_reason: int | None) -> None:
    """Appends a token to sample `index`'s news of this step (several tokens with speculative decoding)."""
    last = delta.seqs[-1] if delta.seqs else None
    if last is None or last.index != index:
        delta.seqs.append(SequenceDelta(index, [tok], None if entry is None else [entry], finish_reason, stop_reason))
        return
    last.new_token_ids.append(tok)
    if entry is not None:
        last.new_logprobs.append(entry)
    last.finish_reason, last.stop_reason = finish_reason, stop_reason
