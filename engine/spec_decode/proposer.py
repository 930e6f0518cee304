"""Which sequences speculate this step, with how many draft tokens, and the acceptance counters.

A sequence proposes only in plain decode (its prompt computed, one sampled token not yet computed), and
never when its grammar constrains it (the bitmask of each draft position would need the grammar advanced
through the drafts). Backoff: a sequence whose drafts keep being rejected halves its draft length, then
stops proposing for a cool-down that doubles while it keeps missing; any accepted draft resets it. So
text the proposer cannot predict costs (almost) nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.request import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import placeholder_drafts
from engine.spec_decode.ngram import propose_ngram

MAX_COOLDOWN = 64      # steps a missing sequence waits at most before it tries again


@dataclass
class SpecState:
    """Per sequence: its draft length now, the backoff after misses, and its token ids as an array for the
    n-gram lookup (appended to as the sequence grows, not converted again every step)."""
    budget: int
    cooldown: int = 0          # steps left without proposing
    next_cooldown: int = 1
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_ids: int = 0

    def token_array(self, token_ids: list[int]) -> np.ndarray:
        if len(token_ids) > len(self.ids):
            grown = np.zeros(max(2 * len(self.ids), len(token_ids) + 256), np.int64)
            grown[:self.num_ids] = self.ids[:self.num_ids]
            self.ids = grown
        self.ids[self.num_ids:len(token_ids)] = token_ids[self.num_ids:]
        self.num_ids = len(token_ids)
        return self.ids[:self.num_ids]


@dataclass
class SpecCounters:
    """Running totals (vLLM's spec_decode counters)."""
    num_drafts: int = 0                  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # accepted drafts at position 0, 1, ...


class SpecProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, running: list[Sequence]) -> None:
        """Sets spec_token_ids of the running sequences that speculate this step (the others get [])."""
        for seq in running:
            seq.spec_token_ids = []
            k = self._room(seq)
            if k > 0:
                seq.spec_token_ids = self._draft(seq, k)

    def _room(self, seq: Sequence) -> int:
        """How many drafts this sequence may verify now (0: it does not speculate)."""
        if (seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens == 0 or seq.matcher is not None
                or seq.request.pooling is not None):
            return 0
        state = seq.spec
        if state is None:
            state = seq.spec = SpecState(self.config.num_speculative_tokens)
        if state.cooldown > 0:
            state.cooldown -= 1
            return 0
        # Up to k + 1 tokens come out of a step: stay within max_tokens and the context.
        left = min(seq.request.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(state.budget, left))

    def _draft(self, seq: Sequence, k: int) -> list[int]:
        cfg = self.config
        if cfg.method == "draft_model":
            return placeholder_drafts(k)       # the draft model fills them once the step is scheduled
        return propose_ngram(seq.spec.token_array(seq.token_ids), k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After verification: counts, and the sequence's next draft length."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.accepted_per_pos[pos] += 1
        state = seq.spec
        if num_accepted == num_drafts:
            state.budget = min(self.config.num_speculative_tokens, state.budget + 1)
            state.next_cooldown = 1
        elif num_accepted > 0:
            state.budget = num_accepted + 1
            state.next_cooldown = 1
        else:
            state.budget //= 2
            if state.budget == 0:
                state.cooldown, state.budget = state.next_cooldown, 1
                state.next_cooldown = min(2 * state.next_cooldown, MAX_COOLDOWN)
