"""Constrained decoding in the engine (tiny random model, CPU): every sampled output satisfies its constraint
through chunked prefill, preemption, n > 1 forks and seeds; compiles are cached, run off the engine loop,
and a slow one fails only its own request."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import xgrammar as xg

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputs
from engine.structured.compiler import GrammarCache
from engine.structured.grammar import build_grammar

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "n": {"type": "integer", "minimum": -50, "maximum": 50},
    "xs": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 9}, "maxItems": 2}},
    "required": ["name", "n", "xs"]}
JSON = StructuredOutputs(json=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", device="cpu", max_num_seqs=16, max_model_len=256)


def _params(spec: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(**{"n": 4, "temperature": 1.0, "max_tokens": 60, "structured_outputs": spec, **kw})


def _check_json(outputs) -> None:
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_every_form_holds_for_every_sample(llm: LLM) -> None:
    _check_json(llm.generate(["a", "b c d"], _params(JSON)))
    regex = r"(cat|dog)s? [0-9]{2}"
    [out] = llm.generate("x", _params(StructuredOutputs(regex=regex)))
    assert all(re.fullmatch(regex, c.text) for c in out.outputs)
    choices = ["red", "green", "light blue"]
    [out] = llm.generate("x", _params(StructuredOutputs(choice=choices)))
    assert all(c.text in choices for c in out.outputs)


def test_control_characters_never_enter_strings() -> None:
    """xgrammar 0.2.8 writes length-bounded strings as [^"\\\\\\r\\n]{m,n}, letting raw U+0000..U+001F in."""
    info = xg.TokenizerInfo([f"<{i}>" for i in range(8)])
    compiler = xg.GrammarCompiler(info)
    for string in ({"type": "string"}, {"type": "string", "maxLength": 5}, {"type": "string", "minLength": 2},
                   {"type": "string", "pattern": "^.*$"}):
        schema = {"type": "object", "properties": {"a": string}, "required": ["a"]}
        compiled = compiler.compile_grammar(build_grammar(StructuredOutputs(json=json.dumps(schema))))
        for code in range(0x20):
            matcher = xg.GrammarMatcher(compiled)
            assert matcher.accept_string('{"a": "')
            assert not matcher.accept_string(chr(code)), (string, code)
        matcher = xg.GrammarMatcher(compiled)
        assert matcher.accept_string('{"a": "ab"}')   # compact: ": " and no other whitespace
        assert not xg.GrammarMatcher(compiled).accept_string('{ "a"')


def test_chunked_prefill_preemption_and_no_leaked_blocks() -> None:
    llm = LLM("tiny-random", device="cpu", max_num_seqs=16, max_model_len=256, max_num_batched_tokens=24,
              num_kv_blocks=17, block_size=16)   # 16 blocks: one request (42 + 4 x 50 tokens) fits alone
    engine = llm.engine
    prompts = [list(range(5, 5 + 40 + i)) for i in range(3)]
    _check_json(llm.generate(prompts, _params(JSON, max_tokens=50)))
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks - 1
    assert not engine.structured.pending


def test_seeds_reproduce_and_unconstrained_rows_are_untouched(llm: LLM) -> None:
    seeded = _params(JSON, seed=7)
    plain = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    alone = llm.generate(["q"], [plain])[0]
    mixed = llm.generate(["q", "r", "s"], [plain, seeded, seeded])
    assert [c.token_ids for c in mixed[0].outputs] == [c.token_ids for c in alone.outputs]
    again = llm.generate(["r"], [seeded])[0]
    assert [c.text for c in again.outputs] == [c.text for c in mixed[1].outputs]
    _check_json(mixed[1:])


def test_same_spec_compiles_once(llm: LLM) -> None:
    spec = StructuredOutputs(regex="[xyz]{3}")
    llm.engine.structured.drain_compile_seconds()
    llm.generate(["a", "b"], [_params(spec), _params(StructuredOutputs(regex="[xyz]{3}"))])
    llm.generate("c", _params(spec))
    assert len(llm.engine.structured.drain_compile_seconds()) == 1


class _Gate:
    """Holds every compile until opened: a slow compile, on demand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        real = GrammarCache._compile

        def slow(cache: GrammarCache, spec: StructuredOutputs):
            self.open.wait(30)
            return real(cache, spec)
        monkeypatch.setattr(GrammarCache, "_compile", slow)


def test_others_run_while_a_grammar_compiles(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate(monkeypatch)
    engine = llm.engine
    engine.add_request("slow", [5, 6, 7], _params(StructuredOutputs(regex="[ab]{4}"), n=2))
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    finished = set()
    for _ in range(20):
        finished |= {d.request_id for d in engine.step() if d.finished}
    assert finished == {"free"} and "slow" in engine.requests      # it waited; the other one ran
    gate.open.set()
    texts = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            for s in d.seqs:
                texts[s.index] = texts.get(s.index, []) + s.new_token_ids
    decoded = [llm.tokenizer.decode(t[:-1] if t[-1] in engine.eos_token_ids else t) for t in texts.values()]
    assert len(decoded) == 2 and all(re.fullmatch("[ab]{4}", t) for t in decoded), decoded


def test_slow_compile_fails_its_request_with_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate(monkeypatch)
    llm = LLM("tiny-random", device="cpu", max_num_seqs=4, max_model_len=128, grammar_compile_timeout=0.2)
    engine = llm.engine
    spec = StructuredOutputs(regex="[cd]{4}")
    engine.add_request("a", [5, 6], _params(spec))
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    [failed] = [d for d in deltas if d.error]
    assert failed.request_id == "a" and failed.error_status == 400 and "took too long" in failed.error
    assert any(d.request_id == "b" and d.finished and not d.error for d in deltas)
    # The same spec again is refused at once while its compile still holds a worker.
    engine.add_request("c", [5, 6], _params(spec))
    [again] = [d for d in engine.step() if d.error]
    assert again.request_id == "c" and again.error_status == 400
    gate.open.set()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks - 1


def test_constraint_starts_after_the_reasoning_end(llm: LLM) -> None:
    end = 42                                  # stands for </think>; logit_bias makes the model write it first
    spec = StructuredOutputs(regex="[pq]{3}", enable_after=[end])
    [out] = llm.generate("x", _params(spec, logit_bias={end: 100.0}, max_tokens=20))
    for c in out.outputs:
        assert c.token_ids[0] == end
        assert re.fullmatch("[pq]{3}", llm.tokenizer.decode(c.token_ids[1:], skip_special_tokens=True))


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm: LLM) -> None:
    [out] = llm.generate("x", _params(StructuredOutputs(choice=["done"]), ignore_eos=True, max_tokens=30))
    assert all(c.text == "done" and c.finish_reason == "stop" for c in out.outputs)


def test_bitmask_masks_exactly_the_disallowed_tokens_of_the_constrained_rows() -> None:
    import torch

    from engine.sampler import _apply_grammar_bitmask
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 100, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=g)
    out = x.clone()
    _apply_grammar_bitmask(out, torch.tensor([1, 3]), mask)
    for row, m in ((1, mask[0]), (3, mask[1])):
        allowed = [(int(m[t // 32]) >> (t % 32)) & 1 for t in range(100)]
        assert all((out[row, t] == x[row, t]) if a else out[row, t] == float("-inf") for t, a in enumerate(allowed))
    assert torch.equal(out[[0, 2, 4]], x[[0, 2, 4]])      # unconstrained rows untouched
    every = x[[1, 3]].clone()                              # every row constrained: no gather
    _apply_grammar_bitmask(every, None, mask)
    assert torch.equal(every, out[[1, 3]])
