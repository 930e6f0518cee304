"""Continuous batching over the paged KV cache.

Every step has a token budget and a sequence budget. Running sequences go first (a decode costs one
token; a sequence part-way through a chunked prefill asks for its next chunk), then waiting ones are
admitted FIFO while budget and blocks last. When a running sequence needs a block and none is free,
the most recently arrived running sequence is preempted: its blocks are freed and it is recomputed
later from its tokens (prefix caching makes that cheap).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import SeqStatus, Sequence

log = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int          # query length this step
    samples: bool                # this chunk reaches the end of the sequence, so a token is sampled (not for
                                 # max_tokens 0: a prompt scored or embedded)
    num_spec_tokens: int = 0     # draft tokens verified after the sequence's last token (in num_new_tokens)


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
    # Consecutive steps that schedule nothing while a request could be admitted: a liveness bug, logged loudly.
    STALL_STEPS = 100

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int = 1 << 31, max_loras: int = 0) -> None:
        self.bm = block_manager
        self.max_loras = max_loras      # distinct LoRA adapters running at once (their slots in the model)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preempted: list[str] = []     # request ids preempted since the engine last drained them
        self.num_idle_steps = 0            # consecutive steps without progress while a sequence could start

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The other samples of an n > 1 request, forked once its first sequence's prompt is prefilled.

        From then on each is a sequence of its own. Those that fit the sequence budget run at once, sharing
        the parent's blocks; the others wait at the head of the queue holding no block, and are computed
        again when they get in, like preempted ones (prefix caching finds the prompt's full blocks). So n is
        never bounded by max_num_seqs, and a request's samples never hold back the queue as one block.
        """
        parent.needs_fork = False
        later = []
        for child in children:
            if len(self.running) < self.max_num_seqs:
                self.bm.fork(parent, child)
                child.status = SeqStatus.RUNNING
                self.running.append(child)
            else:
                later.append(child)
        self.waiting.extendleft(reversed(later))

    def schedule(self) -> SchedulerOutput:
        """Running sequences first (oldest first), then waiting ones FIFO while budgets and blocks last.

        Liveness: a waiting sequence holds no block, and the oldest running one is never preempted for a
        younger one; so the oldest moves every step and, alone, always fits (the door refuses a request
        that could not). A step that had to preempt admits nobody (vLLM does the same): the blocks it freed
        are for the running sequences, and admitting would only preempt again.
        """
        out = SchedulerOutput()
        budget, preempted = self._schedule_running(out)
        if not preempted:
            self._admit_waiting(out, budget)
        out.block_copies = self.bm.pending_copies
        self.bm.pending_copies = []
        self._watch_progress(out)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> tuple[int, bool]:
        budget, preempted = self.max_num_batched_tokens, False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._at_limit(seq):  # nothing to compute (overlap: its token in flight is its last one)
                i += 1
                continue
            num_real = seq.num_tokens - seq.num_computed_tokens
            num_new = min(num_real + len(seq.spec_token_ids), budget)
            num_spec = max(0, num_new - num_real)
            del seq.spec_token_ids[num_spec:]     # the drafts the token budget leaves no room for
            if num_spec and not self.bm.allocate(seq, num_new):   # drafts are never worth a preemption
                seq.spec_token_ids, num_new, num_spec = [], num_real, 0
            while not self.bm.allocate(seq, num_new):
                victim = self.running.pop()     # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, self._samples(seq, num_new - num_spec), num_spec))
                budget -= num_new
                i += 1
        return budget, preempted

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Set aside, keeping their place: a grammar still compiling, or a last token still being sampled
        # (overlap: the step that samples it finishes the sequence).
        set_aside: list[Sequence] = []
        adapters = self.running_adapters()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Also set aside: a request for an adapter beyond the max_loras already running (it waits for a
            # slot to free up; later requests on running adapters or the base go ahead).
            lora_id = seq.request.lora_id
            if not self._admissible(seq) or (lora_id and lora_id not in adapters
                                             and len(adapters) >= self.max_loras):
                set_aside.append(self.waiting.popleft())
                continue
            hit = self.bm.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(hit.block_ids) * self.bm.block_size, budget)
            if not self.bm.admit(seq, hit, num_new):
                break
            if seq.index == 0 and seq.request.num_cached_tokens == 0:
                seq.request.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if lora_id:
                adapters.add(lora_id)
            out.scheduled.append(ScheduledSeq(seq, num_new, self._samples(seq, num_new)))
            budget -= num_new
        self.waiting.extendleft(reversed(set_aside))

    def running_adapters(self) -> set[int]:
        """The LoRA adapters (lora_int_id) of the running sequences: at most max_loras."""
        return {s.request.lora_id for s in self.running if s.request.lora_id}

    def _admissible(self, seq: Sequence) -> bool:
        return seq.request.grammar is None and not self._at_limit(seq)

    def _watch_progress(self, out: SchedulerOutput) -> None:
        """Counts steps that move nothing while a waiting sequence could start, and logs the state once such
        a stall has lasted STALL_STEPS steps: every step must finish work or move a request forward."""
        if out.scheduled or not any(self._admissible(s) for s in self.waiting):
            self.num_idle_steps = 0
            return
        self.num_idle_steps += 1
        if self.num_idle_steps == self.STALL_STEPS:
            log.error("the scheduler made no progress for %d steps while requests wait (a bug): %s",
                      self.num_idle_steps, self.describe())

    def describe(self) -> str:
        """The scheduler's state in one line, for a stall report."""
        bm, head = self.bm, self.waiting[0] if self.waiting else None
        head_s = "none" if head is None else (
            f"request {head.request.request_id} sample {head.index}: {head.num_tokens} tokens, "
            f"{head.num_computed_tokens} computed, {len(head.block_table)} blocks held")
        held = sum(len(s.block_table) for s in self.waiting)
        return (f"{len(self.running)} running, {len(self.waiting)} waiting (holding {held} blocks), "
                f"{bm.num_free_blocks}/{bm.num_usable_blocks} blocks free ({bm.num_cached_free} cached), "
                f"budget {self.max_num_batched_tokens} tokens and {self.max_num_seqs} sequences; "
                f"head of the queue: {head_s}")

    def _at_limit(self, seq: Sequence) -> bool:
        # max_tokens 0 (prompt scoring, embeddings): the prompt is computed, then the engine finishes the
        # sequence; such a prompt may fill the whole context, so the length limits apply to outputs only.
        return (seq.num_computed_tokens >= seq.num_tokens or (seq.num_output_tokens > 0 and (
                seq.num_tokens >= self.max_model_len or seq.num_output_tokens >= max(seq.request.max_tokens, 1))))

    @staticmethod
    def _samples(seq: Sequence, num_new: int) -> bool:
        # max_tokens 0 computes the prompt only: it is scored (prompt_logprobs) or pooled (embeddings), and
        # nothing is sampled, so its last chunk has no sampling row in the batch.
        return seq.num_computed_tokens + num_new == seq.num_tokens and seq.request.max_tokens > 0

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted.append(seq.request.request_id)

    def reject_drafts(self, seq: Sequence, num_rejected: int) -> None:
        """Speculative decoding: the KV written for rejected draft tokens is not the sequence's; those slots
        are written again by its next tokens (its blocks stay allocated, and none past its computed tokens is
        ever published to the prefix cache)."""
        seq.num_computed_tokens -= num_rejected
        seq.spec_token_ids = []

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
