"""The engine always makes progress: KV pressure with prefix caching, n above max_num_seqs.

Budgets are counted in engine steps, never in seconds: a livelocked engine fails the test instead of
hanging it, on any machine.
"""
from __future__ import annotations

import logging
import random

import pytest

from engine import LLM, SamplingParams
from engine.request import SeqStatus
from tests.helpers import make_checkpoint


class StepBudgetExceeded(AssertionError):
    pass


def limit_steps(llm: LLM, max_steps: int) -> list[int]:
    """Makes llm's engine raise after max_steps steps; returns a one-item list counting the steps taken."""
    engine, count = llm.engine, [0]
    step = type(engine).step

    def counted() -> list:
        count[0] += 1
        if count[0] > max_steps:
            raise StepBudgetExceeded(f"no finish within {max_steps} engine steps: "
                                     f"{engine.scheduler.describe()}")
        return step(engine)

    engine.step = counted
    return count


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("progress"), "llama")


def issue_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(23, 64))] for _ in range(8)]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_kv_pressure_with_prefix_caching_finishes(llama, prefix_caching):
    """The issue's workload: 8 prompts of 23-64 tokens, 96 tokens each, 99 blocks of 4 tokens (each
    sequence needs up to 40). With prefix caching on, waiting sequences used to keep the cached blocks they
    had matched, so nothing running could make room: 0 running, 8 waiting, forever."""
    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=4, num_kv_blocks=100,
              max_num_seqs=8, max_model_len=256, enable_prefix_caching=prefix_caching)
    steps = limit_steps(llm, 2000)
    outs = llm.generate(issue_prompts(), SamplingParams(max_tokens=96, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [96] * 8
    assert llm.engine.scheduler.num_preemptions > 0
    assert steps[0] < 2000
    if prefix_caching:
        assert llm.engine.block_manager.prefix_hits > 0    # the preempted ones found their blocks again
    assert_no_leaks(llm)


def test_waiting_sequences_hold_no_blocks(llama):
    """The invariant behind liveness, checked after every step of the issue's workload."""
    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=4, num_kv_blocks=100,
              max_num_seqs=8, max_model_len=256)
    engine = llm.engine
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(issue_prompts()):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        assert all(not s.block_table and s.num_computed_tokens == 0 for s in engine.scheduler.waiting)
        assert all(s.status is SeqStatus.RUNNING for s in engine.scheduler.running)
    assert not engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_n_above_max_num_seqs_completes_and_lets_a_later_request_through(llama):
    """n = 5 with max_num_seqs = 4: the samples run as sequences of their own, so the request is never
    stuck at the head of the queue, and a small request sent after it finishes first."""
    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=4, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("big", list(range(3, 20)), SamplingParams(n=5, max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()                                   # the prompt is prefilled, its samples forked
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 1
    engine.add_request("small", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    finished: list[str] = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        finished += [d.request_id for d in engine.step() if d.finished]
        assert len(engine.scheduler.running) <= 4
    assert finished == ["small", "big"]
    assert_no_leaks(llm)


def test_n_above_max_num_seqs_offline_matches_n_1(llama):
    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=4, max_num_seqs=2)
    limit_steps(llm, 500)
    prompt = list(range(3, 16))
    alone = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    many = llm.generate(prompt, SamplingParams(n=7, max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert [o.index for o in many.outputs] == list(range(7))
    assert all(o.token_ids == alone.outputs[0].token_ids for o in many.outputs)
    assert_no_leaks(llm)


def test_a_stall_is_logged_with_the_scheduler_state(llama, caplog):
    """A step that moves nothing while a request could start is a bug: after STALL_STEPS such steps the
    scheduler logs an error with its state (made here by taking every free block away)."""
    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=4, num_kv_blocks=20)
    engine, bm = llm.engine, llm.engine.block_manager
    hog = list(bm.free)
    for block_id in hog:
        bm._take_free()
    engine.add_request("r", list(range(3, 30)), SamplingParams(max_tokens=4, ignore_eos=True))
    with caplog.at_level(logging.ERROR, logger="engine.scheduler"):
        for _ in range(engine.scheduler.STALL_STEPS):
            engine.step()
    [record] = [r for r in caplog.records if "no progress" in r.getMessage()]
    assert "0 running, 1 waiting" in record.getMessage() and "0/19 blocks free" in record.getMessage()
    for block_id in hog:
        bm._unref(block_id)
    for _ in range(20):
        engine.step()
    assert not engine.has_unfinished_requests() and engine.scheduler.num_idle_steps == 0


def test_prompt_chunks_count_as_progress_for_the_stall_watchdog(llama):
    """The engine loop delivers a step that only computed a prompt chunk (no token for anyone yet), so a long
    chunked prefill never looks like a stalled engine to --engine-stall-timeout."""
    import threading

    from engine.loop import EngineLoop

    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    delivered, done = [], threading.Event()

    def deliver(deltas, stats) -> None:
        delivered.append((deltas, stats))
        if any(d.finished for d in deltas):
            done.set()

    loop = EngineLoop(llm.engine, deliver)
    loop.start()
    try:
        loop.add_request("r", list(range(3, 43)), SamplingParams(max_tokens=2, ignore_eos=True))
        assert done.wait(timeout=120)
    finally:
        loop.shutdown(timeout=10)
    chunks = [stats.step.num_prefill_tokens for deltas, stats in delivered if not deltas and stats.step is not None]
    assert chunks == [8, 8, 8, 8]           # 40 prompt tokens in chunks of 8: four steps with no token, then one


def test_grammar_compile_times_always_reach_the_front_end(llama):
    """A grammar compiles while the engine's steps compute nothing for its request; the compile time that
    stats() drains in such a step is delivered all the same (the front end's compile histogram counts it)."""
    import json
    import threading

    from engine.loop import EngineLoop
    from engine.structured import StructuredOutputs

    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=4)
    delivered, done = [], threading.Event()

    def deliver(deltas, stats) -> None:
        delivered.append(stats)
        if any(d.finished for d in deltas):
            done.set()

    loop = EngineLoop(llm.engine, deliver)
    loop.start()
    try:
        schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
        loop.add_request("r", [3, 4, 5], SamplingParams(max_tokens=16, structured_outputs=StructuredOutputs(
            json=json.dumps(schema))))
        assert done.wait(timeout=120)
    finally:
        loop.shutdown(timeout=10)
    assert len([s for stats in delivered for s in stats.grammar_compile_seconds]) == 1
