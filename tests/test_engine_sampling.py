"""Sampling through the whole engine: seeds are reproducible whatever the batch around them."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import make_checkpoint, random_prompts


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(model=str(make_checkpoint(tmp_path_factory.mktemp("s"), "llama")), device="cpu", block_size=4)


def seeded(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, ignore_eos=True, seed=42, **kw)


def test_seeded_request_ignores_its_batch_neighbours(llm):
    prompt, *others = random_prompts(1000, [9, 4, 30, 17], seed=31)
    alone = llm.generate([prompt], seeded())[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    batch = llm.generate([*others[:2], prompt, others[2]], [noisy, noisy, seeded(), noisy])
    assert batch[2].outputs[0].token_ids == alone


def test_n_seeded_samples_differ_and_repeat(llm):
    prompt = random_prompts(1000, [12], seed=32)[0]
    first = [o.token_ids for o in llm.generate([prompt], seeded(n=3))[0].outputs]
    again = [o.token_ids for o in llm.generate([prompt], seeded(n=3))[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 3


def test_top_k_one_is_greedy(llm):
    prompts = random_prompts(1000, [5, 21], seed=33)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]
