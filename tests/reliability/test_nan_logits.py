"""Non-finite logits never crash sampling or reach a client as NaN, whatever the sampling options: NaN is
never chosen while anything else is left, +inf wins, and a row with nothing usable still yields a token."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams

V = 16
NAN, INF = math.nan, math.inf


def _rows() -> dict[str, list[float]]:
    mixed = [NAN if i % 2 else float(i) for i in range(V)]
    plus_inf = [0.0] * V
    plus_inf[5] = INF
    return {"mixed NaN": mixed, "all NaN": [NAN] * V, "all -inf": [-INF] * V, "one +inf": plus_inf,
            "+inf and NaN": [NAN, INF, *([NAN] * (V - 2))], "huge": [3e38 if i % 3 else -3e38 for i in range(V)]}


SAMPLING = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=1.0),
    "top-k/top-p/min-p": dict(temperature=0.7, top_k=4, top_p=0.5, min_p=0.1),
    "penalties": dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=-1.0, repetition_penalty=1.3),
    "bias and logprobs": dict(temperature=1.0, logit_bias={3: 100.0, 4: -100.0}, logprobs=5),
    "seeded": dict(temperature=1.0, seed=7, logprobs=0),
}


@pytest.mark.parametrize("options", list(SAMPLING))
def test_non_finite_logits(options: str) -> None:
    rows = _rows()
    params = SamplingParams(**SAMPLING[options])
    params.eos_token_ids = [V - 1]
    sampler = Sampler(V, torch.device("cpu"), seed=0)
    generator = sampler.make_generator(params.seed, 0) if params.seed is not None else None
    batch = [SampleRow(params, [1, 2, 3], [2, 2], generator) for _ in rows]
    logits = torch.tensor(list(rows.values()), dtype=torch.float32)
    out = sampler.sample(logits, sampler.prepare(batch))
    tokens = out.token_ids.tolist()
    for token, (name, row) in zip(tokens, rows.items()):
        assert 0 <= token < V, name
        if any(not math.isnan(x) for x in row):
            assert not math.isnan(row[token]), f"{name}: a NaN logit was chosen"
        if name == "one +inf" and "bias" not in options:
            assert token == 5
    if out.logprobs is not None:
        assert not torch.isnan(out.logprobs).any()
        if out.top_logprobs is not None:
            assert not torch.isnan(out.top_logprobs).any()
