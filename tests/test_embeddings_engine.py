"""Embedding requests in the engine (engine/pooling.py): the vectors equal transformers' pooled final hidden
states, under chunked prefill, overlap, preemption and prefix hits, batched in the same steps as generation;
they sample nothing and keep no KV block."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.pooling import embedding_params, embedding_values
from tests.helpers import make_checkpoint, random_prompts

LENGTHS = [1, 7, 16, 29, 45]
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root, arch) for arch in ("llama", "qwen3")}


@torch.inference_mode()
def hf_embedding(path, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' base model (fp32, CPU): its last_hidden_state (after the final norm), pooled, normalized."""
    model = _hf_base(str(path))
    hidden = model(torch.tensor([prompt])).last_hidden_state[0].float()
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1)


_HF: dict = {}


def _hf_base(path: str):
    from transformers import AutoModel
    if path not in _HF:
        _HF[path] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def make_llm(path, pooling: str, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", block_size=4, pooling_type=pooling, **kw)


def assert_close_to_hf(path, prompts, outputs, pooling: str) -> None:
    for prompt, out in zip(prompts, outputs):
        vector = torch.tensor(out.outputs.embedding)
        assert out.prompt_token_ids == prompt and out.finished
        assert abs(vector.norm().item() - 1.0) < 1e-6
        assert (vector - hf_embedding(path, prompt, pooling)).abs().max().item() < TOL


def assert_same(a: list, b: list, atol: float = 1e-6) -> None:
    """Vectors (or lists of them) equal up to float32 rounding of a differently batched computation."""
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting and not llm.engine.requests


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("budget", [2048, 6], ids=["whole", "chunked"])
def test_vectors_match_transformers(checkpoints, arch: str, pooling: str, budget: int) -> None:
    prompts = random_prompts(1000, LENGTHS, seed=len(arch))
    llm = make_llm(checkpoints[arch], pooling, max_num_batched_tokens=budget)
    assert_close_to_hf(checkpoints[arch], prompts, llm.embed(prompts), pooling)
    assert_no_leaks(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_overlap_gives_the_same_vectors(checkpoints, pooling: str) -> None:
    """With async scheduling a step is launched before the previous one resolves: chunks are added up as
    their steps resolve."""
    prompts = random_prompts(1000, LENGTHS, seed=2)
    plain = make_llm(checkpoints["qwen3"], pooling, max_num_batched_tokens=6).embed(prompts)
    llm = make_llm(checkpoints["qwen3"], pooling, max_num_batched_tokens=6, async_scheduling=True)
    overlapped = llm.embed(prompts)
    assert_same([o.outputs.embedding for o in overlapped], [o.outputs.embedding for o in plain])
    assert_no_leaks(llm)


def test_text_and_token_ids_agree(checkpoints) -> None:
    llm = make_llm(checkpoints["llama"], "last")
    texts = ["hello world", "the quick brown fox"]
    by_text = llm.embed(texts)
    by_ids = llm.embed([llm.tokenizer.encode(t) for t in texts])
    single = llm.embed(texts[1])
    assert [o.prompt_token_ids for o in by_text] == [llm.tokenizer.encode(t) for t in texts]
    assert_same([o.outputs.embedding for o in by_text], [o.outputs.embedding for o in by_ids])
    assert_same(single[0].outputs.embedding, by_text[1].outputs.embedding)


def test_batched_with_generation_in_the_same_steps(checkpoints) -> None:
    """Embedding and generation requests share steps; the generated tokens and the vectors are those each
    gets alone, nothing is sampled for an embedding request, and every block comes back."""
    path = checkpoints["qwen3"]
    gen_prompts = random_prompts(1000, [5, 12], seed=7)
    emb_prompts = random_prompts(1000, [9, 30], seed=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = make_llm(path, "mean")
    gen_alone = [o.outputs[0].token_ids for o in alone.generate(gen_prompts, greedy)]
    emb_alone = [o.outputs.embedding for o in alone.embed(emb_prompts)]

    llm = make_llm(path, "mean", max_num_batched_tokens=16)
    engine = llm.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", p, greedy)
    for i, p in enumerate(emb_prompts):
        engine.add_request(f"emb-{i}", p, embedding_params())
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, bytes] = {}
    finish: dict[str, str] = {}
    mixed_steps = 0
    while engine.has_unfinished_requests():
        deltas = engine.step()
        step = engine.stats().step
        ids = {rid for rid, _ in step.prefill_chunks}
        mixed_steps += any(r.startswith("emb") for r in ids) and (
            any(r.startswith("gen") for r in ids) or step.num_decode_seqs > 0)
        for d in deltas:
            for s in d.seqs:
                tokens.setdefault(d.request_id, []).extend(s.new_token_ids)
                if s.finish_reason:
                    finish[d.request_id] = s.finish_reason
            if d.embedding is not None:
                vectors[d.request_id] = d.embedding
    assert mixed_steps > 0
    assert [tokens[f"gen-{i}"] for i in range(2)] == gen_alone
    assert all(tokens[f"emb-{i}"] == [] for i in range(2))             # nothing sampled for them
    assert finish == {"gen-0": "length", "gen-1": "length", "emb-0": "stop", "emb-1": "stop"}
    for i in range(2):
        assert_same(embedding_values(vectors[f"emb-{i}"]), emb_alone[i])
    assert_no_leaks(llm)


def test_preempted_mid_prefill_gives_the_same_vector(checkpoints) -> None:
    """A KV cache too small for everything: generating requests that grow preempt an embedding request part-way
    through its chunked prefill; it is recomputed from the start and its vector is still transformers'."""
    path = checkpoints["llama"]
    gen_prompts = random_prompts(1000, [16, 20], seed=9)
    emb_prompts = random_prompts(1000, [45], seed=10)
    llm = make_llm(path, "mean", num_kv_blocks=21, max_num_batched_tokens=8)
    engine = llm.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.add_request("emb", emb_prompts[0], embedding_params())
    preempted, vector = [], None
    while engine.has_unfinished_requests():
        for d in engine.step():
            vector = d.embedding if d.embedding is not None else vector
        preempted += engine.stats().step.preempted
    assert "emb" in preempted
    got = torch.tensor(embedding_values(vector))
    assert (got - hf_embedding(path, emb_prompts[0], "mean")).abs().max().item() < TOL
    assert_no_leaks(llm)


@pytest.mark.parametrize("pooling, reuses", [("last", True), ("mean", False)])
def test_prefix_cache_serves_last_pooling_only(checkpoints, pooling: str, reuses: bool) -> None:
    """Last pooling needs only the last token's hidden state (always computed), so a cached prefix serves it;
    mean pooling needs every position's, so it computes the whole prompt again. Same vector both times."""
    path = checkpoints["qwen3"]
    prompt = random_prompts(1000, [33], seed=11)[0]
    llm = make_llm(path, pooling)
    first = llm.embed([prompt])[0].outputs.embedding
    hits = llm.engine.block_manager.prefix_hits
    second = llm.embed([prompt])[0].outputs.embedding
    assert llm.engine.block_manager.prefix_hits - hits == (32 if reuses else 0)
    assert_same(second, first)
    assert_close_to_hf(path, [prompt], llm.embed([prompt]), pooling)
    assert_no_leaks(llm)


def test_abort_mid_prefill_frees_the_blocks(checkpoints) -> None:
    llm = make_llm(checkpoints["llama"], "mean", max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("emb", random_prompts(1000, [45], seed=12)[0], embedding_params())
    assert engine.step() == []                       # a first chunk: no news yet
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request("emb")
    assert_no_leaks(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_input_that_fills_the_context(checkpoints, pooling: str) -> None:
    """An input of exactly max_model_len tokens is allowed (nothing is generated after it) and is computed,
    in chunks too; so is a prompt of that length scored with max_tokens 0 (the same prompt-only path)."""
    path = checkpoints["llama"]
    prompt = random_prompts(1000, [64], seed=13)[0]
    llm = make_llm(path, pooling, max_model_len=64, max_num_batched_tokens=16)
    assert_close_to_hf(path, [prompt], llm.embed([prompt]), pooling)
    scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert scored.outputs[0].finish_reason == "length" and len(scored.prompt_logprobs) == 64
    assert_no_leaks(llm)


def test_a_scored_prompt_beside_a_sampled_one_in_one_step(checkpoints) -> None:
    """Prompt-only requests (max_tokens 0: scored, or embedded) have no sampling row: one batched with a request
    that samples leaves the sampler its own rows (it used to fail both with an internal error)."""
    llm = make_llm(checkpoints["llama"], "last")
    prompts = random_prompts(1000, [10, 12], seed=14)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    scored, sampled = llm.generate(prompts, [SamplingParams(max_tokens=0, prompt_logprobs=0), greedy])
    assert scored.outputs[0].finish_reason == "length" and scored.outputs[0].token_ids == []
    assert len(scored.prompt_logprobs) == 10
    assert sampled.outputs[0].token_ids == llm.generate([prompts[1]], greedy)[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_bad_requests_are_refused_before_running(checkpoints) -> None:
    llm = make_llm(checkpoints["llama"], "last", max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens.*embedding"):
        llm.embed([[5] * 10, [5] * 65])
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="max_tokens=0 and n=1"):
        SamplingParams(embed=True, max_tokens=0, n=2)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(embed=True, max_tokens=0, logprobs=1)
    with pytest.raises(ValueError, match="pooling_type"):
        make_llm(checkpoints["llama"], "cls")
    assert_no_leaks(llm)
