"""The engine's constrained-decoding hooks: grammars for new requests, matchers for their sequences, the
step's bitmask, and token acceptance. Everything here runs on the engine thread except the compiles."""
from __future__ import annotations

import logging
import time

import torch
import xgrammar as xg

from engine.request import Request, Sequence
from engine.structured.compiler import GrammarCache
from engine.structured.matcher import SeqMatcher, fill_bitmask

log = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float = 10.0) -> None:
        self.vocab_size = vocab_size
        self._tokenizer, self._stop_ids, self._timeout = tokenizer, list(stop_token_ids), compile_timeout_s
        self._cache: GrammarCache | None = None
        self._batch: xg.BatchGrammarMatcher | None = None
        self.pending: dict[str, Request] = {}        # requests whose grammar is still compiling
        self.num_constrained_total = 0

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:   # built on first use: the vocabulary scan costs a moment for big vocabularies
            self._cache = GrammarCache.for_tokenizer(self._tokenizer, self.vocab_size, self._stop_ids,
                                                     timeout_s=self._timeout)
            self._batch = xg.BatchGrammarMatcher(max_threads=1)
        return self._cache

    def add(self, req: Request) -> None:
        spec = req.params.structured_outputs
        if spec is None:
            return
        req.grammar = self.cache.submit(spec)
        self.pending[req.request_id] = req
        self.num_constrained_total += 1

    def poll(self) -> list[tuple[Request, str]]:
        """Gives every request whose grammar is ready its matcher; returns those whose compile failed."""
        if not self.pending:
            return []
        now, failed = time.monotonic(), []
        for rid, req in list(self.pending.items()):
            if req.finished:                     # aborted while compiling
                del self.pending[rid]
                continue
            outcome = req.grammar.result(now)
            if outcome is None:
                continue
            del self.pending[rid]
            if isinstance(outcome, BaseException):
                if not req.grammar.future.done():
                    self.cache.mark_timed_out(req.grammar)
                failed.append((req, str(outcome)))
                continue
            for seq in req.seqs:   # only sample 0 exists before the prompt is computed; forks copy its matcher
                seq.matcher = SeqMatcher(xg.GrammarMatcher(outcome), req.params.structured_outputs.enable_after)
            req.grammar = None
        return failed

    def discard(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def bitmask(self, rows: list[Sequence], device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(row indices, or None when every row is constrained; bitmask) on the device for this step's
        constrained rows, or None when there are none."""
        if self._batch is None:
            return None
        built = fill_bitmask([s.matcher for s in rows], self.vocab_size, self._batch)
        if built is None:
            return None
        indices, mask = built
        index = None if len(indices) == len(rows) else torch.tensor(indices, device=device)
        return index, mask.to(device, non_blocking=True)

    @staticmethod
    def accept(seq: Sequence, token: int) -> bool:
        """Advances the sequence's matcher; False when its grammar rejects the token (the sequence ends)."""
        if seq.matcher is None or seq.matcher.accept(token):
            return True
        log.warning("sequence %d of %s: its grammar rejects the sampled token %d; finishing it",
                    seq.index, seq.request.request_id, token)
        return False

    @staticmethod
    def is_complete(seq: Sequence) -> bool:
        return seq.matcher is not None and seq.matcher.active and seq.matcher.matcher.is_terminated()

    def drain_compile_seconds(self) -> list[float]:
        return [] if self._cache is None else self._cache.drain_compile_seconds()

    def shutdown(self) -> None:
        if self._cache is not None:
            self._cache.shutdown()
