"""Sampler vs a straightforward per-row reference (float64, Python loops over a tiny vocabulary)."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams

V = 8
EOS = 7


def params(**kw) -> SamplingParams:
    p = SamplingParams(**kw)
    p.eos_token_ids = [EOS]
    return p


def row(p: SamplingParams, prompt=(1, 2), output=(), generator=None) -> SampleRow:
    return SampleRow(p, list(prompt), list(output), generator)


def run(rows: list[SampleRow], logits: torch.Tensor, seed: int = 0):
    sampler = Sampler(logits.shape[1], torch.device("cpu"), seed=seed)
    return sampler.sample(logits, sampler.prepare(rows))


# ------------------------------------------------------------------------------------------ reference
def ref_processed(logits: torch.Tensor, r: SampleRow) -> torch.Tensor:
    """Logits after bias, min_tokens and penalties (what greedy takes the argmax of)."""
    p, x = r.params, logits.double().clone()
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    if len(r.output_token_ids) < p.min_tokens:
        for tok in set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids)):
            x[tok] = -math.inf
    for tok in set(r.prompt_token_ids) | set(r.output_token_ids):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(r.output_token_ids):
        count = r.output_token_ids.count(tok)
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    return x


def ref_probs(logits: torch.Tensor, r: SampleRow) -> torch.Tensor:
    """The distribution a sampled (non-greedy) row draws from."""
    p = r.params
    x = ref_processed(logits, r) / p.temperature
    if p.top_k > 0:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, x.numel()) - 1]
        x[x < kth] = -math.inf
    probs = torch.softmax(x, 0)
    if p.top_p < 1.0:
        mass, keep = 0.0, torch.zeros(x.numel(), dtype=torch.bool)
        for tok in sorted(range(x.numel()), key=lambda t: -probs[t].item()):
            if mass >= p.top_p:
                break
            keep[tok] = True
            mass += probs[tok].item()
        probs = torch.where(keep, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def draw_many(r: SampleRow, logits_row: torch.Tensor, n: int = 6000, seed: int = 0) -> torch.Tensor:
    """n independent draws for one row: n copies of it in one batch."""
    vocab = logits_row.numel()
    out = run([r] * n, logits_row.expand(n, vocab).contiguous(), seed=seed)
    return torch.bincount(out.token_ids, minlength=vocab).double() / n


def assert_matches(freq: torch.Tensor, probs: torch.Tensor, n: int = 6000) -> None:
    assert torch.all(freq[probs == 0] == 0), f"drew a masked token: freq={freq}, probs={probs}"
    support = probs > 0
    chi2 = (n * (freq[support] - probs[support]) ** 2 / probs[support]).sum().item()
    # df <= 7; the 99.99% quantile of chi-square(7) is ~29.9 (the sampler seed is fixed: no flakes).
    assert chi2 < 30, f"chi2={chi2:.1f} freq={freq} probs={probs}"


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])


# ------------------------------------------------------------------------------------------ tests
def test_all_greedy_fast_path_is_argmax():
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(V, torch.device("cpu"))
    st = sampler.prepare([row(params(temperature=0.0))] * 16)
    # Nothing is built for features no row uses: no tensors, no host->device copies.
    assert st.all_greedy and st.temperature is None and st.top_k is None and st.top_p is None
    assert st.bias is None and st.banned is None and st.penalties is None and st.max_logprobs is None
    out = sampler.sample(logits, st)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.ranks is None and out.top_ids is None


def test_top_k_1_equals_greedy():
    logits = torch.randn(32, V, generator=torch.Generator().manual_seed(2))
    sampled = run([row(params(temperature=1.3, top_k=1))] * 32, logits).token_ids
    assert torch.equal(sampled, logits.argmax(-1))


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.2, min_p=0.3),
    dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.2),
])
def test_sampled_distribution_matches_reference(kw):
    r = row(params(**kw))
    assert_matches(draw_many(r, LOGITS), ref_probs(LOGITS, r))


def test_distribution_on_four_tokens():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    r = row(params(temperature=0.8), prompt=[0])
    freq = draw_many(r, logits, n=20000)
    probs = torch.softmax(logits.double() / 0.8, 0)
    chi2 = (20000 * (freq - probs) ** 2 / probs).sum().item()
    assert chi2 < 21.1       # 99.99% quantile of chi-square(3)


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=0.7),
    dict(presence_penalty=-1.1),
    dict(frequency_penalty=0.4, presence_penalty=0.9, repetition_penalty=1.3),
    dict(logit_bias={3: 2.5, 0: -4.0}),
    dict(min_tokens=4, stop_token_ids=[5]),
    dict(min_tokens=4, stop_token_ids=[5], ignore_eos=True),
])
def test_greedy_processing_matches_reference(kw):
    """Random logits and histories: greedy picks the argmax of the reference's processed logits."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, V, generator=gen) * 2
    rows = []
    for _ in range(64):
        prompt = torch.randint(0, V, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        output = torch.randint(0, V, (int(torch.randint(0, 7, (1,), generator=gen)),), generator=gen).tolist()
        rows.append(row(params(temperature=0.0, **kw), prompt, output))
    # One plain greedy row without extras shares the batch: it must be unaffected.
    rows.append(row(params(temperature=0.0), [0, 1, 2], [3, 3]))
    logits = torch.cat([logits, logits[:1]])
    got = run(rows, logits).token_ids
    want = torch.stack([ref_processed(logits[i], r).argmax() for i, r in enumerate(rows)])
    assert torch.equal(got, want)


def test_penalty_changes_sampled_distribution():
    r = row(params(temperature=1.0, frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.5),
            prompt=[0, 4], output=[0, 0, 1, 6])
    assert_matches(draw_many(r, LOGITS), ref_probs(LOGITS, r))


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(4, V)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    rows = [row(params(temperature=0.0, min_tokens=3, stop_token_ids=[5]), output=[1]),       # masked
            row(params(temperature=0.0, min_tokens=3, stop_token_ids=[5]), output=[1, 2, 3]),  # long enough
            row(params(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[5]), output=[]),
            row(params(temperature=1.0, min_tokens=3), output=[])]
    tokens = run(rows, logits).token_ids.tolist()
    assert tokens[0] not in (EOS, 5)
    assert tokens[1] == EOS
    assert tokens[2] == EOS          # ignore_eos: eos is not masked, only stop ids
    assert tokens[3] != EOS


def test_mixed_greedy_and_sampled_batch():
    logits = torch.randn(10, V, generator=torch.Generator().manual_seed(4))
    rows = [row(params(temperature=0.0 if i % 2 else 1.0, top_p=0.9)) for i in range(10)]
    tokens = run(rows, logits).token_ids
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


def test_seeded_rows_reproducible_regardless_of_batch():
    sampler = Sampler(V, torch.device("cpu"), seed=123)
    p = params(temperature=1.0, seed=42)
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(V, generator=gen) for _ in range(8)]

    def trajectory(position: int, batch: int, index: int = 0) -> list[int]:
        g, toks = sampler.make_generator(42, index), []
        for step_logits in steps:
            rows = [row(params(temperature=1.0)) for _ in range(batch)]
            rows[position] = row(p, generator=g)
            logits = torch.randn(batch, V, generator=gen)
            logits[position] = step_logits
            toks.append(int(sampler.sample(logits, sampler.prepare(rows)).token_ids[position]))
        return toks

    alone = trajectory(0, 1)
    assert trajectory(3, 5) == alone and trajectory(1, 2) == alone
    others = [trajectory(0, 1, index=i) for i in (1, 2, 3)]
    assert any(t != alone for t in others), "sample indices must get distinct streams"


def test_logprobs_ranks_and_top_are_of_raw_logits():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    rows = [row(params(temperature=0.0, logprobs=3, logit_bias={0: 50.0})),
            row(params(temperature=1.0, logprobs=0, repetition_penalty=2.0)),
            row(params(temperature=0.5))]
    out = run(rows, logits)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids[0] == 0                            # the bias decided the token ...
    chosen = raw.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, chosen)            # ... but logprobs ignore it
    want_ranks = (raw > chosen[:, None]).sum(-1) + 1
    assert torch.equal(out.ranks, want_ranks)
    assert out.top_ids.shape == (3, 3)
    assert torch.allclose(out.top_logprobs, raw.sort(-1, descending=True).values[:, :3])
    assert torch.equal(raw.gather(1, out.top_ids), out.top_logprobs)


def test_nan_and_inf_rows_do_not_crash():
    nan = float("nan")
    logits = torch.tensor([
        [nan, 1.0, 3.0, nan, 0.0, 0.0, 0.0, 0.0],        # NaN never wins
        [nan] * V,                                       # nothing usable: token 0
        [-math.inf] * V,
        [0.0, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # +inf wins
    ])
    for kw in (dict(temperature=0.0), dict(temperature=0.0, logprobs=2), dict(temperature=1.0, top_p=0.9),
               dict(temperature=0.7, min_p=0.1, top_k=3, logprobs=1)):
        out = run([row(params(**kw))] * 4, logits)
        tokens = out.token_ids.tolist()
        if kw["temperature"] == 0.0:
            assert tokens[0] == 2
        assert tokens[0] not in (0, 3) and tokens[1] == 0 and tokens[2] == 0 and tokens[3] == 1
        if out.logprobs is not None:
            assert not torch.isnan(out.logprobs).any() and not torch.isnan(out.top_logprobs).any()


def test_out_of_vocab_bias_is_a_value_error():
    sampler = Sampler(V, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.prepare([row(params(logit_bias={V + 3: 1.0}))])


def test_unseeded_rows_use_sampler_seed():
    rows = [row(params(temperature=1.0))] * 64
    logits = torch.zeros(64, V)
    a, b, c = run(rows, logits, seed=1), run(rows, logits, seed=1), run(rows, logits, seed=2)
    assert torch.equal(a.token_ids, b.token_ids) and not torch.equal(a.token_ids, c.token_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_matches_cpu_semantics():
    cuda = torch.device("cuda")
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(7))
    rows = [row(params(temperature=0.0, repetition_penalty=1.5, logit_bias={2: 1.0}), output=[1, 3]),
            row(params(temperature=0.0, min_tokens=2, logprobs=2), output=[]),
            row(params(temperature=1.0, top_k=3, top_p=0.9, min_p=0.05, seed=1))] * 2
    cpu_out = run(rows, logits)
    sampler = Sampler(V, cuda, seed=0)

    def seeded_rows():
        return [SampleRow(r.params, r.prompt_token_ids, r.output_token_ids,
                          sampler.make_generator(9, 0) if r.params.seed is not None else None) for r in rows]

    a = sampler.sample(logits.to(cuda), sampler.prepare(seeded_rows()))
    b = sampler.sample(logits.to(cuda), sampler.prepare(seeded_rows()))
    greedy = [0, 1, 3, 4]
    assert torch.equal(a.token_ids.cpu()[greedy], cpu_out.token_ids[greedy])
    assert torch.equal(a.token_ids, b.token_ids) and a.token_ids[2] == a.token_ids[5]
    assert torch.allclose(a.logprobs.cpu(), cpu_out.logprobs, atol=1e-5)
