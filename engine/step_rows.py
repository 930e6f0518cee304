"""Per step: which rows the sampler draws, and whether a token ends its sequence."""
from __future__ import annotations

from collections.abc import Callable

from engine.request import Sequence
from engine.sampler import SampleRow
from engine.scheduler import ScheduledSeq


def sampling_rows(sampling: list[ScheduledSeq], fork: Callable[[Sequence], list[Sequence]]
              ) -> tuple[list[Sequence], list[int], list[SampleRow], list[list[int]]]:
    """The sampled rows in order: one per sequence, n for a request's first sample (its forks sample from
    the same logits: counts says how often each logits row repeats), 1 + k for a sequence verifying k
    drafts (each row sees the drafts before it as outputs, for penalties and min_tokens); and each
    row group's drafts."""
    rows: list[Sequence] = []
    counts: list[int] = []
    sample_rows: list[SampleRow] = []
    drafts: list[list[int]] = []
    for item in sampling:
        seq = item.seq
        family = [seq, *fork(seq)] if seq.needs_fork else [seq]
        spec = seq.spec_token_ids[:item.num_spec_tokens]
        for j in range(len(spec)):
            sample_rows.append(SampleRow(seq.params, seq.request.prompt_token_ids,
                                         seq.output_token_ids + spec[:j], seq.generator))
        rows += [seq] * len(spec) + family
        counts += [1] * len(spec) + [len(family)]
        sample_rows += [SampleRow(s.params, s.request.prompt_token_ids, s.output_token_ids + spec, s.generator)
                        for s in family]
        drafts += [spec] + [[]] * (len(family) - 1)
    return rows, counts, sample_rows, drafts


def finish_reason(seq: Sequence, tok: int, pos: int, max_model_len: int, grammar_complete: bool
                  ) -> tuple[str | None, int | None]:
    """(finish_reason, stop_reason) when token `tok` at position `pos` ends the sequence, else (None, None):
    eos and stop_token_ids once min_tokens are out, a grammar that admits nothing more, then the length limits."""
    p = seq.params
    num_output = pos + 1 - seq.num_prompt_tokens
    if num_output >= p.min_tokens:
        if not p.ignore_eos and tok in p.eos_token_ids:
            return "stop", None
        if tok in p.stop_token_ids:
            return "stop", tok
    if grammar_complete:        # e.g. ignore_eos: nothing may follow
        return "stop", None
    if num_output >= seq.request.max_tokens or pos + 1 >= max_model_len:
        return "length", None
    return None, None
