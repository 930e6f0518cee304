"""Greedy tokens and logprobs equal transformers', alone and under chunked prefill, preemption, prefix hits."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import hf_greedy, make_checkpoint, random_prompts

MAX_TOKENS = 12
LENGTHS = [1, 7, 16, 29, 45]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root, arch) for arch in ("llama", "mistral", "qwen2", "qwen3")}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def run(path, prompts, params=None, **engine_kw):
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=4, **engine_kw)
    outs = llm.generate(prompts, params or greedy())
    return llm, outs


def assert_matches_hf(path, prompts, outs):
    for prompt, out in zip(prompts, outs):
        ref, _ = hf_greedy(path, prompt, MAX_TOKENS)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


def assert_no_leaks(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(checkpoints, arch):
    prompts = random_prompts(1000, LENGTHS, seed=len(arch))
    llm, outs = run(checkpoints[arch], prompts)
    assert_matches_hf(checkpoints[arch], prompts, outs)
    assert_no_leaks(llm)


def test_chunked_prefill_matches(checkpoints):
    prompts = random_prompts(1000, LENGTHS, seed=3)
    llm, outs = run(checkpoints["qwen3"], prompts, max_num_batched_tokens=6)
    assert_matches_hf(checkpoints["qwen3"], prompts, outs)
    assert_no_leaks(llm)


def test_preemption_matches_and_frees(checkpoints):
    prompts = random_prompts(1000, LENGTHS, seed=4)
    # 45 + 12 tokens need 15 blocks of 4: 20 blocks cannot hold all five sequences at once
    llm, outs = run(checkpoints["llama"], prompts, num_kv_blocks=21)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(checkpoints["llama"], prompts, outs)
    assert_no_leaks(llm)


def test_prefix_cache_hits_match(checkpoints):
    shared = random_prompts(1000, [33], seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(1000, [3, 9, 1], seed=6)]
    llm = LLM(model=str(checkpoints["qwen2"]), device="cpu", dtype="float32", block_size=4)
    first = llm.generate(prompts, greedy())
    hits_before = llm.engine.block_manager.prefix_hits
    second = llm.generate(prompts, greedy())
    assert llm.engine.block_manager.prefix_hits - hits_before >= 3 * 32
    assert second[0].num_cached_tokens == 32
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert_matches_hf(checkpoints["qwen2"], prompts, second)
    assert_no_leaks(llm)


def test_logprobs_match_transformers(checkpoints):
    prompts = random_prompts(1000, [5, 20], seed=7)
    llm, outs = run(checkpoints["mistral"], prompts, params=greedy(logprobs=3))
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lps = hf_greedy(checkpoints["mistral"], prompt, MAX_TOKENS)
        lps = out.outputs[0].logprobs
        assert [e.token_id for e in lps] == ref_tokens
        for entry, ref in zip(lps, ref_lps):
            assert abs(entry.logprob - ref) < 1e-4
            assert entry.rank == 1 and len(entry.top) == 3
            assert entry.top[0][0] == entry.token_id and abs(entry.top[0][1] - entry.logprob) < 1e-6


def test_n_samples_share_prompt_blocks(checkpoints):
    """n greedy samples of one prompt fork its blocks (copy-on-write of the partial last block)."""
    prompts = random_prompts(1000, [10, 13], seed=8)
    llm, outs = run(checkpoints["llama"], prompts, params=greedy(n=3))
    for prompt, out in zip(prompts, outs):
        ref, _ = hf_greedy(checkpoints["llama"], prompt, MAX_TOKENS)
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert all(o.token_ids == ref for o in out.outputs)
    assert llm.engine.block_manager.prefix_queries == 10 + 13  # the prompt was prefilled once per request
    assert_no_leaks(llm)
