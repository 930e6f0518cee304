"""Rejection sampling of draft tokens (engine/spec_decode/rejection.py): the emitted tokens are distributed as
the target's own samples, for n-gram (point-mass) drafts and draft-model drafts, and greedy rows accept exactly
the argmax. The statistical bounds come from the sample size: each frequency is within 5 standard deviations
of its probability (a false alarm has probability < 1e-5 per category)."""
from __future__ import annotations

import math
from functools import partial

import torch

from engine.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection import REJECTED, DraftTensors, verify_drafts

V = 6
N = 40_000          # sequences verified in one batch
GEN = torch.Generator().manual_seed(7)
LOGITS = torch.randn(3, V, generator=GEN) * 1.5     # target logits at draft positions 0, 1 and the bonus row


def params(**kw) -> SamplingParams:
    p = SamplingParams(**kw)
    p.eos_token_ids = [V - 1]
    return p


def verify(p: SamplingParams, drafts: list[list[int]], logits: torch.Tensor, draft_probs=None, seed=0):
    """drafts: per sequence; logits: one row per sequence row, in order. Returns the sampler's output."""
    sampler = Sampler(V, torch.device("cpu"), seed=seed)
    rows = [SampleRow(p, [1], [], None) for _ in range(logits.shape[0])]
    st = sampler.prepare(rows)
    st.drafts = DraftTensors.build(drafts, torch.device("cpu"))
    st.drafts.draft_probs = draft_probs
    return sampler.sample(logits, st, pick=partial(verify_drafts, sampler))


def target_probs(p: SamplingParams) -> torch.Tensor:
    x = LOGITS.double() / p.temperature
    if p.top_k > 0:
        kth = x.topk(p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    return x.softmax(-1)


def assert_distributed(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    n = tokens.numel()
    assert n > 1000, "too few samples for the bound"
    freq = torch.bincount(tokens, minlength=V).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), (freq, probs)


def test_ngram_drafts_emit_the_targets_distribution():
    p = params(temperature=1.0)
    probs = target_probs(p)
    d1, d2 = int(probs[0].argmax()), int(probs[1].argmin())   # a likely and an unlikely draft
    tokens = verify(p, [[d1, d2]] * N, LOGITS.repeat(N, 1)).token_ids.view(N, 3)
    assert_distributed(tokens[:, 0], probs[0])
    second = tokens[tokens[:, 0] == d1, 1]                   # after an accepted first draft
    assert_distributed(second, probs[1])
    third = tokens[(tokens[:, 0] == d1) & (tokens[:, 1] == d2), 2]
    assert third.numel() > 0 and (third >= 0).all()
    # After the first token that is not the draft, nothing more is emitted.
    assert (tokens[tokens[:, 0] != d1, 1:] == REJECTED).all()
    assert (tokens[(tokens[:, 0] == d1) & (tokens[:, 1] != d2), 2] == REJECTED).all()


def test_draft_model_drafts_emit_the_targets_distribution():
    p = params(temperature=0.8, top_k=4)
    probs = target_probs(p).float()
    q = torch.softmax(torch.randn(V, generator=GEN), -1)      # the draft model's distribution, position 0
    drafts = torch.multinomial(q, N, replacement=True, generator=GEN)
    draft_probs = torch.stack([q, torch.full((V,), 1.0 / V)]).repeat(N, 1)     # the bonus row's is unused
    tokens = verify(p, [[int(d)] for d in drafts], LOGITS[[0, 2]].repeat(N, 1), draft_probs).token_ids.view(N, 2)
    assert_distributed(tokens[:, 0], probs[0].double())     # top_k: tokens outside it never come out
    accepted = tokens[:, 0] == drafts
    assert_distributed(tokens[accepted, 1], probs[2].double())
    assert (tokens[~accepted, 1] == REJECTED).all()


def test_greedy_accepts_exactly_the_argmax():
    argmax = LOGITS.argmax(-1).tolist()
    wrong = (argmax[1] + 1) % V
    drafts = [[argmax[0], argmax[1]], [argmax[0], wrong], [wrong, argmax[1]], []]
    logits = torch.cat([LOGITS, LOGITS, LOGITS, LOGITS[2:]])
    out = verify(params(temperature=0.0, logprobs=1), drafts, logits)
    rows = out.token_ids.tolist()
    assert rows[0:3] == argmax                               # both accepted, then the bonus argmax
    assert rows[3:6] == [argmax[0], argmax[1], REJECTED]     # second rejected: its argmax instead
    assert rows[6:9] == [argmax[0], REJECTED, REJECTED]
    assert rows[9:] == [argmax[2]]
    raw = torch.log_softmax(LOGITS, -1)
    assert out.logprobs[0].item() == raw[0, argmax[0]].item()


def test_seeded_verification_repeats():
    gen_a = torch.Generator().manual_seed(3)
    gen_b = torch.Generator().manual_seed(3)
    p = params(temperature=1.0, seed=3)
    outs = []
    for gen in (gen_a, gen_b):
        sampler = Sampler(V, torch.device("cpu"), seed=len(outs))     # different global seeds
        rows = [SampleRow(p, [1], [], gen) for _ in range(3)]
        st = sampler.prepare(rows)
        st.drafts = DraftTensors.build([[1, 2]], torch.device("cpu"))
        outs.append(sampler.sample(LOGITS, st, pick=partial(verify_drafts, sampler)).token_ids.tolist())
    assert outs[0] == outs[1]
