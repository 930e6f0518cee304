"""Speculative decoding with a draft model (method draft_model): greedy output token-identical to decoding
without it, batched with chunked prefill, preemption and prefix hits; sampled output distributed as the
target's; the draft's vocabulary is checked at startup."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.helpers import make_checkpoint, random_prompts
from tests.test_spec_decode import (
    assert_counters_add_up,
    assert_no_leaks,
    assert_targets_distribution,
    greedy,
    make_llm,
    peaked_copy,
    prompts_with_repeats,
    tokens_of,
)

K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_checkpoint(root, "llama")
    small = make_checkpoint(root / "small", "llama", num_hidden_layers=1)      # other weights: drafts often wrong
    return {"target": target, "small": small, "peaked": peaked_copy(target, tmp_path_factory.mktemp("peaked"))}


def spec(draft) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


@pytest.mark.parametrize("draft", ["small", "target"])
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 24}, {"num_kv_blocks": 48}],
                         ids=["batched", "chunked", "preempted"])
def test_greedy_identical(models, draft, engine_kw):
    prompts = prompts_with_repeats(seed=6)
    ref = tokens_of(make_llm(models["target"], None, **engine_kw).generate(prompts, greedy()))
    llm = make_llm(models["target"], spec(models[draft]), **engine_kw)
    assert tokens_of(llm.generate(prompts, greedy())) == ref
    assert_counters_add_up(llm, K)
    c = llm.engine.spec.counters
    if draft == "target":       # the target as its own draft: every greedy draft is its own argmax
        assert c.num_accepted_tokens == c.num_draft_tokens
    else:
        assert c.num_accepted_tokens < c.num_draft_tokens
    if "num_kv_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_prefix_hits_keep_the_drafts_cache(models):
    """A prefix hit reuses blocks whose draft KV the mirrored steps wrote: the drafts stay the target's argmax."""
    shared = random_prompts(1000, [40], seed=9)[0]
    prompts = [shared + [3 + i] for i in range(5)]
    ref = tokens_of(make_llm(models["target"], None).generate(prompts, greedy(20)))
    llm = make_llm(models["target"], spec(models["target"]))
    got = [llm.generate([p], greedy(20))[0].outputs[0].token_ids for p in prompts]
    assert got == ref
    assert llm.engine.block_manager.prefix_hits > 0
    c = llm.engine.spec.counters
    assert c.num_accepted_tokens == c.num_draft_tokens > 0      # a stale draft cache would miss here
    assert_no_leaks(llm)


def test_sampling_is_the_targets_distribution(models):
    """Target: the peaked model; draft: the same weights with a flatter head, so its samples are often
    accepted and often not (both branches of the rejection sampler)."""
    llm = make_llm(models["peaked"], spec(models["target"]))
    prompts = [random_prompts(1000, [12], seed=i)[0] for i in range(25)] * 4
    outs = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=i)
                                  for i in range(len(prompts))])
    c = llm.engine.spec.counters
    assert c.num_accepted_tokens > 100 and c.num_draft_tokens - c.num_accepted_tokens > 100, c
    assert_targets_distribution(models["peaked"], prompts, outs)


def test_another_vocabulary_is_refused(models, tmp_path):
    other = make_checkpoint(tmp_path, "llama", vocab_size=2048)
    with pytest.raises(ValueError, match="--speculative-config.*another vocabulary"):
        make_llm(models["target"], spec(other))
    with pytest.raises(ValueError, match="--speculative-config.*cannot be used"):
        make_llm(models["target"], spec(tmp_path / "missing"))
