"""The engine's side of speculative decoding, in the order of a step: proposals before scheduling (n-gram
drafts, or the draft model's room), the draft model's tokens once the scheduler has made room for them, the
verify rows' tensors for the sampler, and after the step which drafts were accepted (counted, backoff)."""
from __future__ import annotations

import logging

import torch

from engine.request import Sequence
from engine.runner_setup import ModelPlan
from engine.sampler import SamplingTensors
from engine.scheduler import ScheduledSeq
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.proposer import SpecCounters, SpecProposer
from engine.spec_decode.rejection import DraftTensors

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SpeculativeConfig, plan: ModelPlan, num_blocks: int, vocab_size: int,
                 target_vocab: dict[str, int], device: torch.device) -> None:
        self.proposer = SpecProposer(config, plan.max_model_len)
        self.draft = None if config.method != "draft_model" else DraftModel(
            config, plan, num_blocks, vocab_size, target_vocab, device)
        self.device = device
        if self.draft is None:
            log.info("speculative decoding: ngram, up to %d draft tokens per step (lookup of %d..%d tokens)",
                     config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)

    @property
    def counters(self) -> SpecCounters:
        return self.proposer.counters

    def propose(self, running: list[Sequence]) -> None:
        self.proposer.propose(running)

    def fill(self, scheduled: list[ScheduledSeq]) -> None:
        """The draft model's tokens in place of the placeholder drafts the scheduler made room for."""
        proposing = [item for item in scheduled if item.num_spec_tokens]
        if self.draft is not None and proposing:
            self.draft.propose(proposing)

    def attach(self, st: SamplingTensors, rows: list[Sequence], drafts: list[list[int]]) -> None:
        """What the sampler verifies: each row group's drafts (and the draft model's distributions)."""
        if not any(drafts):
            return
        st.drafts = DraftTensors.build(drafts, self.device)
        if self.draft is not None and not st.all_greedy:
            st.drafts.draft_probs = self.draft.probs_rows(rows, drafts)

    def settle(self, rows: list[Sequence], tokens: list[int], verified: list[tuple[Sequence, int]]
               ) -> list[tuple[Sequence, int]]:
        """(sequence, drafts rejected) for each sequence that verified drafts; counted, and its next draft
        length set. A row's token is < 0 past its sequence's first rejection."""
        if not verified:
            return []
        emitted: dict[int, int] = {}
        for seq, tok in zip(rows, tokens):
            emitted[seq.seq_id] = emitted.get(seq.seq_id, 0) + (tok >= 0)
        out = []
        for seq, k in verified:
            num_accepted = emitted[seq.seq_id] - 1
            self.proposer.record(seq, k, num_accepted)
            out.append((seq, k - num_accepted))
        return out
