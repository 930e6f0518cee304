"""Per-sequence grammar matchers and the per-step token bitmask.

A sequence's matcher has accepted exactly its generated tokens (after `enable_after`, the end of the
model's reasoning, when the request set it). Recompute after preemption re-runs the forward over tokens
already generated but samples none of them again, so the matcher needs no rollback: its state is still
that of the sequence's last token.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import xgrammar as xg

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SeqMatcher:
    matcher: xg.GrammarMatcher
    enable_after: list[int] | None = None     # still free-running until these tokens were generated
    _tail: list[int] | None = None            # the last tokens seen while free-running

    @property
    def active(self) -> bool:
        return self.enable_after is None

    def fork(self) -> SeqMatcher:
        return SeqMatcher(self.matcher.fork(), self.enable_after, list(self._tail or []))

    def accept(self, token: int) -> bool:
        """Advances by one generated token; False when the grammar cannot take it."""
        if self.enable_after is not None:
            tail = (self._tail or []) + [token]
            n = len(self.enable_after)
            self._tail = tail[-n:]
            if self._tail == self.enable_after:
                self.enable_after = self._tail = None     # reasoning ended: constrained from the next token
            return True
        if self.matcher.is_terminated():
            return True
        return self.matcher.accept_token(token)


def fill_bitmask(matchers: list[SeqMatcher | None], vocab_size: int,
                 batch: xg.BatchGrammarMatcher) -> tuple[list[int], torch.Tensor] | None:
    """Row indices of the constrained rows and their [R, ceil(V/32)] int32 allowed-token bitmask, filled on
    the host in one batched call; None when no row is constrained this step (nothing extra is copied or
    applied then). A fresh buffer each step: a launched step may still be reading the previous one."""
    rows = [i for i, m in enumerate(matchers) if m is not None and m.active]
    if not rows:
        return None
    mask = xg.allocate_token_bitmask(len(rows), vocab_size)
    batch.batch_fill_next_token_bitmask([matchers[i].matcher for i in rows], mask)
    return rows, mask
