"""The engine's per-step stats (what the dashboard reads): KV block states kept incrementally equal a full
recount after every step; each step's prefill chunks add up to the prompt tokens computed, its decodes to
the tokens generated after the first, its preemptions to the scheduler's counter; ModelInfo's byte counts."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import make_checkpoint, random_prompts


def recount(bm: BlockManager) -> tuple[int, int]:
    """(used, cached-and-free) by looking at every block."""
    used = sum(1 for b in bm.blocks[1:] if b.ref_count > 0)
    cached = sum(1 for b in bm.blocks[1:] if b.ref_count == 0 and b.hash is not None)
    return used, cached


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("stats"), "llama")


@pytest.mark.parametrize("overlap", [False, True])
def test_step_stats_add_up(path, overlap: bool) -> None:
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=20,
                                 max_num_batched_tokens=16, async_scheduling=overlap))
    shared = random_prompts(1000, [12], seed=3)[0]
    prompts = [shared + p for p in random_prompts(1000, [5, 9, 3, 14], seed=4)] + [shared]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, params)
    chunk_tokens: dict[str, int] = {}
    decodes = preempted = generated = 0
    cached_seen = False
    while eng.has_unfinished_requests():
        for delta in eng.step():
            generated += sum(len(s.new_token_ids) for s in delta.seqs)
        stats = eng.stats()
        assert (stats.kv_blocks_used, stats.kv_blocks_cached) == recount(eng.block_manager)
        assert stats.kv_blocks_used == round(stats.kv_cache_usage * eng.block_manager.num_usable_blocks)
        cached_seen |= stats.kv_blocks_cached > 0
        step = stats.step
        assert step is not None and step.seconds > 0
        assert step.num_prefill_tokens == sum(n for _, n in step.prefill_chunks)
        for rid, n in step.prefill_chunks:
            chunk_tokens[rid] = chunk_tokens.get(rid, 0) + n
        decodes += step.num_decode_seqs
        preempted += len(step.preempted)
        assert eng.stats().step is None          # drained: a stats() without a step carries none
    assert preempted == eng.scheduler.num_preemptions > 0
    assert cached_seen
    # Without preemption every prompt token not served from the prefix cache is computed once in chunks;
    # a preempted request recomputes, so chunks cover at least that.
    for i, prompt in enumerate(prompts):
        assert chunk_tokens[f"r{i}"] >= len(prompt) - eng.block_manager.prefix_hits
    assert generated == len(prompts) * 12
    # Each request's first token comes from its last prefill chunk; each later one from a decode, except
    # tokens recomputed as chunks after a preemption.
    assert decodes <= generated - len(prompts)
    assert decodes >= generated - len(prompts) - 12 * preempted


def test_model_info_describes_the_device(path) -> None:
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    info, cfg = eng.info, eng.model.config
    assert info.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    params = {id(p): p.numel() * 4 for p in eng.model.parameters()}
    assert 0 < info.weight_bytes <= sum(params.values())
    assert info.memory_bandwidth is None and not info.cuda_graphs and info.device_name.startswith("cpu")
