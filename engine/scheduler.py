"""Continuous batching over the paged KV cache.

Every step has a token budget and a sequence budget. Running sequences go first (a decode costs one
token; a sequence part-way through a chunked prefill asks for its next chunk), then waiting ones are
admitted FIFO while budget and blocks last. When a running sequence needs a block and none is free,
the most recently arrived running sequence is preempted: its blocks are freed and it is recomputed
later from its tokens (prefix caching makes that cheap).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int          # query length this step
    samples: bool                # this chunk reaches the end of the sequence, so a token is sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        return all(s.num_new_tokens == 1 for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int = 1 << 31) -> None:
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preempted: list[str] = []     # request ids preempted since the engine last drained them

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._at_limit(seq):  # nothing to compute (overlap: its token in flight is its last one)
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, self._samples(seq, num_new)))
                budget -= num_new
                i += 1
        num_seqs = sum(s.params.n if s.needs_fork else 1 for s in self.running)
        compiling: list[Sequence] = []   # their grammar is not ready: they keep their place, others go by
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.request.grammar is not None:
                compiling.append(self.waiting.popleft())
                continue
            width = seq.params.n if seq.needs_fork else 1
            if num_seqs + width > self.max_num_seqs:
                break
            if seq.num_computed_tokens == 0 and not seq.block_table:
                self._on_first_schedule(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, num_new):
                if not self.running:  # nothing will ever free a block: keep it waiting but drop hits
                    self.bm.free_seq(seq)
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, self._samples(seq, num_new)))
            budget -= num_new
            num_seqs += width
        self.waiting.extendleft(reversed(compiling))
        out.block_copies = self.bm.pending_copies
        self.bm.pending_copies = []
        return out

    def _on_first_schedule(self, seq: Sequence) -> None:
        cached = self.bm.match_prefix(seq)
        if seq.index == 0 and seq.request.num_cached_tokens == 0:
            seq.request.num_cached_tokens = cached

    def _at_limit(self, seq: Sequence) -> bool:
        # max_tokens 0 (prompt scoring): the prompt is computed, then the engine finishes the sequence.
        return (seq.num_computed_tokens >= seq.num_tokens or seq.num_tokens >= self.max_model_len
                or seq.num_output_tokens >= max(seq.request.max_tokens, 1))

    @staticmethod
    def _samples(seq: Sequence, num_new: int) -> bool:
        return seq.num_computed_tokens + num_new == seq.num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted.append(seq.request.request_id)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | None = None) -> None:
        """Free a sequence's blocks and take it out of the queues (finish or abort)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
