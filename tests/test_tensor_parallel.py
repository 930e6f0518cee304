"""Tensor parallelism on CPU (2 gloo ranks): greedy fp32 tokens equal the single-process engine's, with
chunked prefill, preemption and prefix hits in the same runs; shard shapes and startup errors."""
from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.distributed import parallel_state as ps
from engine.models.config import ModelConfig
from tests.helpers import make_checkpoint, random_prompts

MAX_TOKENS = 10
# 45 + 10 tokens need 14 blocks of 4: 24 blocks cannot hold all sequences at once -> preemption;
# a 6-token budget chunks every prompt longer than that; the shared 20-token head gives prefix hits.
ENGINE_KW = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=6,
                 max_num_seqs=4)


def workload() -> list[list[int]]:
    shared = random_prompts(1000, [20], seed=11)[0]
    tails = random_prompts(1000, [1, 9, 25, 3], seed=12)
    return [shared + t for t in tails] + random_prompts(1000, [45, 2], seed=13)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_match_one(tmp_path, arch):
    # the test models have 4 heads and 2 KV heads: one of each... two heads and one KV head per rank
    path = make_checkpoint(tmp_path, arch)
    prompts = workload()
    single = LLM(model=str(path), **ENGINE_KW)
    ref = single.generate(prompts, greedy())
    with LLM(model=str(path), tensor_parallel_size=2, **ENGINE_KW) as llm:
        outs = llm.generate(prompts, greedy(logprobs=2))
        again = llm.generate(prompts[:2], greedy())      # prefix hits over a whole request
        eng = llm.engine
        assert eng.scheduler.num_preemptions > 0
        assert eng.block_manager.prefix_hits > 0
        assert again[0].num_cached_tokens > 0
        assert_no_leaks(llm)
        # each rank holds half of the heads, the MLP and the vocabulary
        full, local = eng.model.full_config, eng.model.config
        assert local.num_heads * 2 == full.num_heads
        assert eng.model.embed_tokens.weight.shape[0] == ps.padded_vocab(full.vocab_size, 2)
        assert eng.runner.kv_cache.shape[-2] == max(1, full.num_kv_heads // 2)
    for r, o, a in zip(ref, outs, again + [None] * len(ref)):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        if a is not None:
            assert a.outputs[0].token_ids == r.outputs[0].token_ids
    lps = [e.logprob for e in outs[0].outputs[0].logprobs]
    assert all(lp <= 0 for lp in lps) and len(lps) == MAX_TOKENS


def test_kv_heads_replicated_when_fewer_than_ranks(tmp_path):
    """One KV head over 2 ranks: both hold it; tokens still equal the single-process engine's."""
    path = make_checkpoint(tmp_path, "llama", num_key_value_heads=1)
    prompts = random_prompts(1000, [5, 17], seed=14)
    ref = LLM(model=str(path), device="cpu", dtype="float32", block_size=4).generate(prompts, greedy())
    with LLM(model=str(path), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, greedy())
        assert llm.engine.runner.kv_cache.shape[-2] == 1
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=1001, hidden_size=64, intermediate_size=96,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False,
                qk_norm=False, sliding_window=None)
    return ModelConfig(**{**base, **kw})


def test_shard_shapes_and_vocab_padding():
    local = ps.shard_config(_cfg(), 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 48, 501)
    assert ps.shard_config(_cfg(), 4).num_kv_heads == 1                        # 2 KV heads over 4 ranks
    assert [ps.kv_head_start(2, r, 4) for r in range(4)] == [0, 0, 1, 1]       # replicated pairwise


@pytest.mark.parametrize("kw,tp,words", [
    (dict(num_heads=6, num_kv_heads=6), 4, "attention heads"),
    (dict(num_heads=12, num_kv_heads=3), 4, "KV heads"),
    (dict(intermediate_size=90), 4, "MLP width"),
])
def test_indivisible_shapes_are_refused(kw, tp, words):
    with pytest.raises(ValueError, match=words):
        ps.check_divisible(_cfg(**kw), tp)


def test_startup_errors_are_value_errors(tmp_path):
    path = make_checkpoint(tmp_path, "llama")    # 4 heads
    with pytest.raises(ValueError, match="attention heads"):
        LLM(model=str(path), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        LLM(model=str(path), device="cpu", tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model=str(path), device="cpu", tensor_parallel_size=2, async_scheduling=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            LLM(model=str(path), device="cuda", tensor_parallel_size=2)


def test_failed_load_leaves_no_rank_behind(tmp_path):
    """Every rank refuses a checkpoint with a missing tensor: a ValueError, no worker, no process group."""
    path = make_checkpoint(tmp_path, "llama")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(str(file))
    del tensors["model.norm.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors"):
        LLM(model=str(path), device="cpu", tensor_parallel_size=2)
    assert not dist.is_initialized()
    assert not multiprocessing.active_children()


def test_two_ranks_with_ngram_speculation_match_one(tmp_path):
    """Verify steps (several query tokens per sequence, rolled back after rejections) on two ranks."""
    path = make_checkpoint(tmp_path, "llama")
    prompts = [p + p[: len(p) // 2] for p in workload()]
    ref = LLM(model=str(path), **ENGINE_KW).generate(prompts, greedy())
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(model=str(path), tensor_parallel_size=2, speculative_config=spec, **ENGINE_KW) as llm:
        outs = llm.generate(prompts, greedy())
        assert llm.engine.spec.counters.num_accepted_tokens > 0
        assert_no_leaks(llm)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
