"""Speculative decoding's counters (vLLM's spec_decode_* metrics), from the engine's running totals.

  pagedserve_spec_decode_num_drafts_total                sequence-steps that verified draft tokens
  pagedserve_spec_decode_num_draft_tokens_total          draft tokens verified
  pagedserve_spec_decode_num_accepted_tokens_total       draft tokens accepted
  pagedserve_spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at draft position 0, 1, ...

Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from engine.outputs import EngineStats

FAMILIES = ("pagedserve_spec_decode_num_drafts", "pagedserve_spec_decode_num_draft_tokens",
            "pagedserve_spec_decode_num_accepted_tokens", "pagedserve_spec_decode_num_accepted_tokens_per_pos")


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, families: dict, model_name: str,
                 num_speculative_tokens: int) -> None:
        docs = ("Sequence-steps that verified speculative draft tokens.", "Draft tokens verified.",
                "Draft tokens accepted.", "Draft tokens accepted, by position in the draft (0 = first).")
        counters = []
        for name, doc in zip(FAMILIES, docs):
            labels = ["model_name", "position"] if name.endswith("per_pos") else ["model_name"]
            families[name] = Counter(name, doc, labels, registry=registry)
            counters.append(families[name])
        self.drafts, self.draft_tokens, self.accepted = (c.labels(model_name) for c in counters[:3])
        self.per_pos = [counters[3].labels(model_name, str(pos)) for pos in range(num_speculative_tokens)]
        self._seen = EngineStats()

    def observe(self, stats: EngineStats) -> None:
        seen = self._seen
        for counter, now, before in ((self.drafts, stats.spec_num_drafts_total, seen.spec_num_drafts_total),
                                     (self.draft_tokens, stats.spec_num_draft_tokens_total,
                                      seen.spec_num_draft_tokens_total),
                                     (self.accepted, stats.spec_num_accepted_tokens_total,
                                      seen.spec_num_accepted_tokens_total)):
            if now > before:
                counter.inc(now - before)
        before_pos = seen.spec_accepted_per_pos_total or [0] * len(self.per_pos)
        for counter, now, before in zip(self.per_pos, stats.spec_accepted_per_pos_total, before_pos):
            if now > before:
                counter.inc(now - before)
        self._seen = stats
