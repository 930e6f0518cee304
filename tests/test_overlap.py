"""The overlapped loop (step N+1 launched before step N's tokens reach the host) changes nothing visible."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import make_checkpoint, random_prompts


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("o"), "llama")


def run(path, overlap: bool, requests, abort_after: dict | None = None, **kw):
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4,
                                 async_scheduling=overlap, **kw))
    eng.record_timings = True
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    tokens = {rid: {} for rid in requests}
    finish = {}
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                eng.abort_request(rid)
        for d in eng.step():
            for s in d.seqs:
                tokens[d.request_id].setdefault(s.index, []).extend(s.new_token_ids)
                if s.finish_reason:
                    finish[(d.request_id, s.index)] = (s.finish_reason, s.stop_reason)
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and not eng.requests
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert len(eng.step_timings) > 0 and all(t.forward > 0 for t in eng.step_timings)
    eng.executor.shutdown()
    return eng, tokens, finish


def mixed_requests():
    prompts = random_prompts(1000, [3, 11, 26, 40, 7], seed=11)
    greedy = dict(temperature=0.0, ignore_eos=True)
    return {
        "a": (prompts[0], SamplingParams(max_tokens=9, **greedy)),
        "b": (prompts[1], SamplingParams(max_tokens=14, n=2, **greedy)),
        "c": (prompts[2], SamplingParams(max_tokens=5, temperature=0.9, seed=123)),
        "d": (prompts[3], SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=7, n=3)),
        "e": (prompts[4], SamplingParams(max_tokens=8, repetition_penalty=1.3, presence_penalty=0.5, seed=1)),
    }


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 24}])
def test_overlap_gives_identical_tokens(path, engine_kw):
    _, sync_tokens, sync_finish = run(path, False, mixed_requests(), **engine_kw)
    eng, overlap_tokens, overlap_finish = run(path, True, mixed_requests(), **engine_kw)
    assert overlap_tokens == sync_tokens
    assert overlap_finish == sync_finish
    assert len(sync_tokens["d"]) == 3 and len(sync_tokens["b"][1]) == 14
    if "num_kv_blocks" in engine_kw:
        assert eng.scheduler.num_preemptions > 0


def test_overlap_stops_on_stop_token_and_abort(path):
    prompt = random_prompts(1000, [6], seed=12)[0]
    _, ref, _ = run(path, False, {"x": (prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))})
    stop_at = ref["x"][0][3]
    requests = {
        "x": (prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at])),
        "y": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    }
    for overlap in (False, True):
        _, tokens, finish = run(path, overlap, requests, abort_after={"y": 5})
        first = ref["x"][0].index(stop_at)
        assert tokens["x"][0] == ref["x"][0][:first + 1]
        assert finish[("x", 0)] == ("stop", stop_at)
        assert len(tokens["y"][0]) < 30 and ("y", 0) not in finish


def test_aborting_one_sample_before_the_fork_ends_the_request(path):
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4))
    eng.add_request("r", random_prompts(1000, [9], seed=13)[0], SamplingParams(n=3, max_tokens=5))
    eng.abort_request("r", seq_index=0, finish_reason="stop")
    assert not eng.has_unfinished_requests()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
