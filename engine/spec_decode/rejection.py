"""Verification of draft tokens by rejection sampling, on the device, for a whole step at once.

For each draft position the target's distribution p is the one the sampler would sample from there
(penalties, bias, min_tokens, temperature, top-k/top-p/min-p: each row is built with the outputs before it,
drafts included). A draft token d, proposed with probability q(d), is accepted with probability
min(1, p(d) / q(d)); at the first rejection a token is drawn from the residual max(0, p - q), renormalised;
when every draft is accepted, the bonus row samples from p. The tokens that come out are distributed
exactly as the target's own samples (Leviathan et al., 2023). An n-gram draft is a point mass (q(d) = 1):
accept with probability p(d), else draw from p without d. Greedy rows accept exactly the argmax, so greedy
output equals decoding without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import Sampler, SamplingTensors, gumbel_argmax, temper

REJECTED = -1       # the token of a row after its sequence's first rejection: discarded


@dataclass
class DraftTensors:
    """Rows of a step with draft tokens: each sampling sequence has 1 + k rows, the first k verifying its
    drafts and the last (the bonus row) sampling after them; a sequence without drafts has its one row."""
    draft_ids: torch.Tensor              # [R] int64: the draft token a row verifies, -1 on a sequence's last row
    group: torch.Tensor                  # [R] int64: the row's sequence (0..num_groups-1)
    offset: torch.Tensor                 # [R] int64: the row's place in its sequence's rows
    num_groups: int
    draft_probs: torch.Tensor | None = None   # [R, V] the draft model's distribution; None: point masses (ngram)

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device) -> DraftTensors:
        """drafts: per sampling sequence, its draft tokens ([] for none); one host->device copy."""
        draft_ids, group, offset = [], [], []
        for g, tokens in enumerate(drafts):
            draft_ids += tokens + [-1]
            group += [g] * (len(tokens) + 1)
            offset += range(len(tokens) + 1)
        packed = torch.tensor([draft_ids, group, offset], dtype=torch.int64).to(device)
        return cls(packed[0], packed[1], packed[2], len(drafts))


def verify_drafts(sampler: Sampler, x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """x: the processed logits [R, V] (edited in place). Returns per row the token it emits: the draft where
    accepted, the resampled (or bonus) token at the sequence's first rejection, REJECTED after it."""
    d = st.drafts
    has_draft = d.draft_ids >= 0
    draft = d.draft_ids.clamp_min(0)
    greedy_ids = x.argmax(-1) if st.any_greedy else None
    if st.all_greedy:
        accept, resampled = has_draft & (greedy_ids == draft), greedy_ids
    else:
        accept, resampled = _sampled(sampler, x, st, has_draft, draft)
        if greedy_ids is not None:
            accept = torch.where(st.greedy_mask, has_draft & (greedy_ids == draft), accept)
            resampled = torch.where(st.greedy_mask, greedy_ids, resampled)
    # The first row of each sequence that does not accept (its last row never does) ends its output there.
    stop = torch.where(accept, d.offset.new_tensor(1 << 30), d.offset)
    first_stop = torch.full((d.num_groups,), 1 << 30, dtype=torch.int64, device=x.device)
    first_stop.scatter_reduce_(0, d.group, stop, reduce="amin")
    cut = first_stop[d.group]
    return torch.where(d.offset < cut, draft, torch.where(d.offset == cut, resampled, REJECTED))


def _sampled(sampler: Sampler, x: torch.Tensor, st: SamplingTensors, has_draft: torch.Tensor,
             draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    temper(x, st)
    probs = x.softmax(-1)
    p_draft = probs.gather(1, draft.unsqueeze(1)).squeeze(1)
    if st.drafts.draft_probs is None:       # point mass at the draft: the residual is p without it
        q_draft = torch.ones_like(p_draft)
        residual = probs.scatter(1, draft.unsqueeze(1), torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
    else:
        q = st.drafts.draft_probs
        q_draft = q.gather(1, draft.unsqueeze(1)).squeeze(1)
        residual = torch.where(has_draft.unsqueeze(1), (probs - q).clamp_min_(0.0), probs)
    noise = sampler.uniform(torch.empty(x.shape[0], x.shape[1] + 1, device=x.device), st)
    accept = has_draft & (noise[:, -1] * q_draft < p_draft)
    resampled = gumbel_argmax(residual.log_(), noise[:, :-1].contiguous())
    return accept, resampled
