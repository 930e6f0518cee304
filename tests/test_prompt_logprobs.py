"""prompt_logprobs: the log-probability of every prompt token but the first, equal to transformers' log-softmax,
alone, under chunked prefill, batching, preemption, n > 1, and with the prefix cache cold and warm."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import hf_model, make_checkpoint, random_prompts

K = 3
TOL = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


@torch.inference_mode()
def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the log-softmax of position p's logits (it scores token p + 1)."""
    logits = hf_model(str(path))(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def assert_prompt_logprobs(path, prompt: list[int], entries, k: int = K) -> None:
    ref = hf_prompt_logprobs(path, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for pos, entry in enumerate(entries[1:]):
        row = ref[pos]
        assert entry.token_id == prompt[pos + 1]
        assert abs(entry.logprob - row[prompt[pos + 1]].item()) < TOL
        assert entry.rank == int((row > row[prompt[pos + 1]]).sum()) + 1
        top_values, top_ids = row.topk(k)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert all(abs(v - r) < TOL for (_, v), r in zip(entry.top, top_values.tolist()))


def llm_for(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", block_size=4, **kw)


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_match_transformers_in_a_busy_chunked_batch(checkpoint, overlap):
    prompts = random_prompts(1000, [2, 9, 23, 40], seed=11)
    # every long prompt is cut into chunks; with overlap, step N + 1 is launched before step N resolves
    llm = llm_for(checkpoint, max_num_batched_tokens=7, async_scheduling=overlap)
    params = [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K if i % 2 == 0 else None,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 2 == 0:
            assert_prompt_logprobs(checkpoint, prompt, out.prompt_logprobs)
        else:
            assert out.prompt_logprobs is None
        assert len(out.outputs[0].token_ids) == 4
    assert_no_leaks(llm)


def test_prefix_cache_warm_and_cold_give_the_same_prompt_logprobs(checkpoint):
    prompt = random_prompts(1000, [30], seed=12)[0]
    llm = llm_for(checkpoint)
    cold = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K))[0]
    # The prompt's blocks are cached now: an ordinary request reuses them...
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.num_cached_tokens == 28
    # ...but one that asks for prompt logprobs computes every position again (a cached block has no logits).
    warm = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K))[0]
    assert warm.num_cached_tokens == 0
    assert_prompt_logprobs(checkpoint, prompt, cold.prompt_logprobs)
    assert_prompt_logprobs(checkpoint, prompt, warm.prompt_logprobs)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_no_leaks(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_max_tokens_zero_scores_the_prompt_only(checkpoint, overlap):
    prompts = random_prompts(1000, [17, 5], seed=13)
    llm = llm_for(checkpoint, max_num_batched_tokens=6, async_scheduling=overlap)
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))
    for prompt, out in zip(prompts, outs):
        assert [(o.index, o.token_ids, o.text, o.finish_reason) for o in out.outputs] == [
            (0, [], "", "length"), (1, [], "", "length")]
        assert_prompt_logprobs(checkpoint, prompt, out.prompt_logprobs, k=0)
        assert all(e.top == [] for e in out.prompt_logprobs[1:])
    assert_no_leaks(llm)


def test_prompt_logprobs_survive_preemption_and_n_samples(checkpoint):
    prompts = random_prompts(1000, [21, 26, 30], seed=14)
    # 30 + 20 tokens need 13 blocks of 4: 24 usable blocks cannot hold every sample at once
    llm = llm_for(checkpoint, num_kv_blocks=25)
    params = SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=1, n=2, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(checkpoint, prompt, out.prompt_logprobs, k=1)
        assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert_no_leaks(llm)


def test_ordinary_steps_score_nothing(checkpoint):
    """Requests that do not ask pay nothing: no prompt rows reach the logits."""
    llm = llm_for(checkpoint)
    rows = []
    forward = llm.engine.runner.forward

    def counting_forward(inputs):
        rows.append(inputs.prompt_logits_indices.shape[0])
        return forward(inputs)

    llm.engine.runner.forward = counting_forward
    llm.generate(random_prompts(1000, [12, 8], seed=15), SamplingParams(temperature=0.0, max_tokens=3))
    assert rows and set(rows) == {0}


def test_bounds_are_refused_at_the_door(checkpoint):
    llm = llm_for(checkpoint, max_logprobs=4)
    with pytest.raises(ValueError, match="prompt_logprobs asks for 5 alternatives.*--max-logprobs"):
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=5))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
