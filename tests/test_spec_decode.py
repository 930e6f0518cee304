"""Speculative decoding with n-gram drafts (engine/spec_decode/): greedy output is token-identical to decoding
without it (alone, in mixed batches, with chunked prefill, preemption and prefix hits, counts asserted),
sampled output is distributed as the target's, stops cut where they would, and the counters add up."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import SpecProposer
from tests.helpers import hf_greedy, hf_model, make_checkpoint, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
LENGTHS = [1, 7, 16, 29, 45, 3, 60, 12, 33, 5, 21, 40, 9, 2, 50, 18]    # 16 mixed lengths


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("spec"), "llama")


def prompts_with_repeats(seed: int) -> list[list[int]]:
    """Random prompts that repeat a stretch of themselves, so the n-gram lookup has something to find."""
    return [p + p[: max(1, len(p) // 2)] for p in random_prompts(1000, LENGTHS, seed=seed)]


def make_llm(path, spec: dict | None, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", block_size=4, speculative_config=spec, **kw)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens_of(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def watch_mixed_steps(llm: LLM) -> dict[str, int]:
    """Counts scheduled steps that verify drafts, and those that also carry a prompt chunk."""
    counts = {"verify": 0, "chunk_and_verify": 0}
    schedule = llm.engine.scheduler.schedule

    def watched():
        out = schedule()
        verify = any(i.num_spec_tokens for i in out.scheduled)
        chunk = any(i.seq.num_computed_tokens + i.num_new_tokens <= i.seq.num_prompt_tokens for i in out.scheduled)
        counts["verify"] += verify
        counts["chunk_and_verify"] += verify and chunk
        return out

    llm.engine.scheduler.schedule = watched
    return counts


def assert_counters_add_up(llm: LLM, k: int = NGRAM["num_speculative_tokens"]) -> None:
    c = llm.engine.spec.counters
    assert c.num_drafts > 0 and c.num_accepted_tokens > 0, c
    assert c.num_accepted_tokens <= c.num_draft_tokens
    assert c.num_drafts <= c.num_draft_tokens <= c.num_drafts * k
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens
    assert all(a >= b for a, b in zip(c.accepted_per_pos, c.accepted_per_pos[1:]))   # accepted in order


@pytest.mark.parametrize("engine_kw", [
    {},
    {"max_num_batched_tokens": 24},                      # chunked prefill beside verification steps
    {"num_kv_blocks": 48},                               # preemption
], ids=["batched", "chunked", "preempted"])
def test_greedy_identical_batched(ckpt, engine_kw):
    prompts = prompts_with_repeats(seed=1)
    ref = tokens_of(make_llm(ckpt, None, **engine_kw).generate(prompts, greedy()))
    llm = make_llm(ckpt, NGRAM, **engine_kw)
    mixed = watch_mixed_steps(llm)
    assert tokens_of(llm.generate(prompts, greedy())) == ref
    assert_counters_add_up(llm)
    assert mixed["verify"] > 0
    if "max_num_batched_tokens" in engine_kw:      # prompt chunks in the same steps as verifications
        assert mixed["chunk_and_verify"] > 0
    if "num_kv_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_greedy_identical_alone_and_equal_to_transformers(ckpt):
    prompts = prompts_with_repeats(seed=2)[:4]
    llm = make_llm(ckpt, NGRAM)
    for prompt in prompts:
        out = llm.generate([prompt], greedy(16))[0]
        assert out.outputs[0].token_ids == hf_greedy(ckpt, prompt, 16)[0]
    assert_counters_add_up(llm)
    assert_no_leaks(llm)


def test_prefix_hits_with_drafts(ckpt):
    """Rejected drafts' KV is never published: later requests hit the cache and still decode the same."""
    shared = random_prompts(1000, [40], seed=5)[0]
    prompts = [shared + shared[:10] + [3 + i] for i in range(6)]
    ref = tokens_of(make_llm(ckpt, None).generate(prompts, greedy(32)))
    llm = make_llm(ckpt, NGRAM)
    got = [llm.generate([p], greedy(32))[0].outputs[0].token_ids for p in prompts]
    assert got == ref
    assert llm.engine.block_manager.prefix_hits > 0
    assert_counters_add_up(llm)
    # Decoded tokens of a finished request are found again (blocks of accepted tokens were published).
    again = llm.generate([prompts[0] + ref[0][:20]], greedy(8))[0]
    assert again.num_cached_tokens >= len(prompts[0]) // 4 * 4
    assert_no_leaks(llm)


def test_stops_cut_where_they_would(ckpt):
    prompts = prompts_with_repeats(seed=3)[:8]
    free = tokens_of(make_llm(ckpt, None).generate(prompts, greedy(30)))
    stop_ids = [free[i][7] for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[t], logprobs=2) for t in stop_ids]
    ref = make_llm(ckpt, None).generate(prompts, params)
    llm = make_llm(ckpt, NGRAM)
    got = llm.generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (r.outputs[0].finish_reason,
                                                                           r.outputs[0].stop_reason)
        assert [e.token_id for e in g.outputs[0].logprobs] == g.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):     # the target model's logprobs
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    for n in (1, 5, 13):
        out = llm.generate(prompts[:4], greedy(n))
        assert tokens_of(out) == [f[:n] for f in free[:4]]
    assert_counters_add_up(llm)
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def peaked_ckpt(ckpt, tmp_path_factory):
    return peaked_copy(ckpt, tmp_path_factory.mktemp("peaked"))


def peaked_copy(ckpt, out):
    """The tiny model with its LM head scaled up: at temperature 1 its distributions are peaked enough that
    drafts are often accepted and often rejected (a random model's are nearly flat: nothing to accept)."""
    for f in ckpt.iterdir():
        shutil.copyfile(f, out / f.name)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 12
    save_file(weights, out / "model.safetensors")
    return out


def test_sampling_is_the_targets_distribution(peaked_ckpt):
    # The peaked model's own text repeats itself now and then, which is what the n-gram lookup finds.
    llm = make_llm(peaked_ckpt, NGRAM)
    prompts = [random_prompts(1000, [20], seed=i)[0] for i in range(30)] * 4
    outs = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=i)
                                  for i in range(len(prompts))])
    c = llm.engine.spec.counters
    # Both outcomes are exercised: accepted drafts, and tokens drawn from the residual after a rejection.
    assert c.num_accepted_tokens > 10 and c.num_draft_tokens - c.num_accepted_tokens > 100, c
    assert_targets_distribution(peaked_ckpt, prompts, outs)


def assert_targets_distribution(ckpt, prompts: list[list[int]], outs) -> None:
    """Randomised probability integral transform: each sampled token's CDF value under transformers'
    distribution at its position is uniform when the tokens are the target's samples. KS bound at
    alpha = 1e-3 for the number of values (1.95 / sqrt(n))."""
    model = hf_model(str(ckpt))
    gen = torch.Generator().manual_seed(0)
    values = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ids = prompt + out.outputs[0].token_ids
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].double(), -1)
            for pos, tok in enumerate(out.outputs[0].token_ids):
                cdf_before = probs[pos, :tok].sum().item()
                values.append(cdf_before + torch.rand((), generator=gen, dtype=torch.float64).item()
                              * probs[pos, tok].item())
    values = torch.tensor(sorted(values), dtype=torch.float64)
    n = values.numel()
    ecdf_hi = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = max((ecdf_hi - values).abs().max().item(), (values - (ecdf_hi - 1 / n)).abs().max().item())
    assert ks < 1.95 / n ** 0.5, (ks, n)


def test_backoff_stops_proposing_after_misses():
    proposer = SpecProposer(SpeculativeConfig.parse(NGRAM), max_model_len=1000)
    from engine.spec_decode.proposer import SpecState

    class Seq:
        spec = SpecState(budget=4)
    seq = Seq()
    budgets = []
    for _ in range(4):
        proposer.record(seq, seq.spec.budget, 0)
        budgets.append((seq.spec.budget, seq.spec.cooldown))
    assert budgets == [(2, 0), (1, 0), (1, 1), (1, 2)]
    proposer.record(seq, 1, 1)
    assert (seq.spec.budget, seq.spec.next_cooldown) == (2, 1)
    c = proposer.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (5, 9, 1, [1, 0, 0, 0])


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram"}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup_min"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
    ('{"method": "ngram", "num_speculative_tokens": 2, "temperature": 1}', "unsupported keys"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_config_names_the_flag(value, message):
    with pytest.raises(ValueError, match="--speculative-config") as err:
        SpeculativeConfig.parse(value)
    assert message in str(err.value)


def test_penalties_bias_and_min_tokens_see_the_drafts(ckpt):
    """Each verify row's penalties count the drafts before it as outputs: greedy output with penalties,
    logit_bias and min_tokens is the same as without speculation."""
    prompts = prompts_with_repeats(seed=7)[:8]
    free = tokens_of(make_llm(ckpt, None).generate(prompts, greedy(20)))
    params = [SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.02, frequency_penalty=0.05,
                             presence_penalty=0.02, logit_bias={free[i][3]: 0.5}, min_tokens=6,
                             stop_token_ids=[free[i][2]]) for i in range(len(prompts))]
    ref = make_llm(ckpt, None).generate(prompts, params)
    llm = make_llm(ckpt, NGRAM)
    got = llm.generate(prompts, params)
    assert [(g.outputs[0].token_ids, g.outputs[0].finish_reason) for g in got] == \
        [(r.outputs[0].token_ids, r.outputs[0].finish_reason) for r in ref]
    assert [r.outputs[0].token_ids for r in ref] != [f[:len(r.outputs[0].token_ids)] for f, r in zip(free, ref)]
    assert llm.engine.spec.counters.num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_seeded_samples_repeat_and_n_samples_finish(ckpt):
    prompts = prompts_with_repeats(seed=8)[:6]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=5, n=3)
    first = make_llm(ckpt, NGRAM).generate(prompts, params)
    llm = make_llm(ckpt, NGRAM)
    again = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]
    assert all(len(c.token_ids) == 20 for o in again for c in o.outputs)
    assert_no_leaks(llm)


def test_constrained_requests_do_not_speculate(ckpt):
    """A grammar-constrained request decodes exactly as without speculation (it never proposes drafts)."""
    prompts = prompts_with_repeats(seed=9)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_outputs={"regex": "[a-z]{3,12}( [a-z]{2,8}){2,4}"})
    ref = tokens_of(make_llm(ckpt, None).generate(prompts, params))
    llm = make_llm(ckpt, NGRAM)
    assert tokens_of(llm.generate(prompts, params)) == ref
    assert llm.engine.spec.counters.num_drafts == 0
    assert_no_leaks(llm)


def test_lora_requests_speculate_too(ckpt, tmp_path):
    """Verify rows of a request with an adapter carry its slot: output equal to the LoRA engine without drafts."""
    from engine import LoRARequest
    from tests.lora_adapters import make_adapter
    adapter = make_adapter(ckpt, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], rank=8, alpha=16, seed=1)
    prompts = prompts_with_repeats(seed=10)[:6]
    loras = [LoRARequest("a", 1, str(adapter)), None] * 3
    ref = tokens_of(make_llm(ckpt, None, enable_lora=True, max_lora_rank=8).generate(prompts, greedy(),
                                                                                       lora_request=loras))
    llm = make_llm(ckpt, NGRAM, enable_lora=True, max_lora_rank=8)
    assert tokens_of(llm.generate(prompts, greedy(), lora_request=loras)) == ref
    assert_counters_add_up(llm)
    assert_no_leaks(llm)
