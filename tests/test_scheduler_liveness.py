"""Liveness as a property: random workloads under KV pressure always finish, within a step budget.

Each example builds a fresh offline engine on the tiny Llama checkpoint with a small KV cache (just big
enough for its largest request alone, plus a few blocks), a small token budget and a small sequence budget,
with prefix caching and overlapped scheduling on or off, and runs requests of random lengths, with and
without shared prefixes, with n from 1 to above max_num_seqs. Every generate call must finish within a
budget of engine steps that follows from the scheduler's liveness argument (the oldest running sequence is
never preempted and moves every step, so the steps are at most the tokens of every sample, plus one step per
sample for the overlapped loop's last token in flight); greedy tokens must equal those of each prompt run
alone with a large cache, and every KV block must be free again afterwards. Over all examples, preemptions
and prefix-cache hits must both have happened.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from tests.helpers import make_checkpoint
from tests.test_engine_progress import assert_no_leaks, limit_steps

BS = 4
MAX_TOKENS = 12
VOCAB = 1000


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    n: int
    max_tokens: int

    @property
    def blocks_alone(self) -> int:
        return -(-(len(self.prompt) + self.n * self.max_tokens) // BS)


@dataclass(frozen=True)
class Workload:
    requests: tuple[Req, ...]
    max_num_seqs: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    prefix_caching: bool
    overlap: bool

    @property
    def step_budget(self) -> int:
        samples = sum(r.n for r in self.requests)
        return sum(r.n * (len(r.prompt) + r.max_tokens) for r in self.requests) + 2 * samples + 2


def tokens(min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(3, VOCAB - 1), min_size=min_size, max_size=max_size)   # 0..2: special tokens


@st.composite
def workloads(draw) -> Workload:
    max_num_seqs = draw(st.integers(1, 4))
    prefixes = [draw(tokens(4, 20)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        shared = draw(st.sampled_from([None, 0, 1]))
        prompt = (prefixes[shared] if shared is not None else []) + draw(tokens(1, 20))
        requests.append(Req(tuple(prompt), draw(st.integers(1, max_num_seqs + 2)), draw(st.integers(1, MAX_TOKENS))))
    # The cache fits the largest request alone and little more: the others must wait or be preempted.
    num_kv_blocks = 1 + max(r.blocks_alone for r in requests) + draw(st.integers(0, 3))
    return Workload(tuple(requests), max_num_seqs, num_kv_blocks, draw(st.sampled_from([3, 8, 16, 64])),
                    draw(st.booleans()), draw(st.booleans()))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("liveness"), "llama")


@pytest.fixture(scope="module")
def reference(llama):
    """Greedy tokens of one prompt run alone with a large cache (a prefix of them for fewer max_tokens)."""
    llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              enable_prefix_caching=False)
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: tuple[int, ...]) -> list[int]:
        if prompt not in cache:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            cache[prompt] = llm.generate(list(prompt), params)[0].outputs[0].token_ids
        return cache[prompt]

    return greedy


def test_random_workloads_under_kv_pressure_finish_and_match(llama, reference):
    seen: Counter[str] = Counter()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(workloads())
    def finishes_and_matches(w: Workload) -> None:
        llm = LLM(model=str(llama), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=w.num_kv_blocks,
                  max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
                  enable_prefix_caching=w.prefix_caching, async_scheduling=w.overlap, max_model_len=128)
        steps = limit_steps(llm, w.step_budget)
        params = [SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
                  for r in w.requests]
        outs = llm.generate([list(r.prompt) for r in w.requests], params)
        for req, out in zip(w.requests, outs):
            expected = reference(req.prompt)[:req.max_tokens]
            assert [o.index for o in out.outputs] == list(range(req.n))
            assert all(o.token_ids == expected and o.finish_reason == "length" for o in out.outputs)
        assert_no_leaks(llm)
        llm.engine.executor.shutdown()
        bm = llm.engine.block_manager
        seen["preemptions"] += llm.engine.scheduler.num_preemptions
        seen["prefix_hits"] += bm.prefix_hits
        seen["n_over_max_num_seqs"] += any(r.n > w.max_num_seqs for r in w.requests)
        seen["steps"] += steps[0]

    finishes_and_matches()
    assert seen["preemptions"] > 0 and seen["prefix_hits"] > 0 and seen["n_over_max_num_seqs"] > 0, seen
