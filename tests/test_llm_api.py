"""The offline API: prompt forms, ordering, stop strings, validation."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import make_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(model=str(make_checkpoint(tmp_path_factory.mktemp("l"), "qwen2")), device="cpu", block_size=8)


def test_text_and_token_prompts_agree_and_keep_order(llm):
    prompts = ["hello world", "the quick brown fox", "a"]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_text = llm.generate(prompts, greedy)
    by_ids = llm.generate([llm.tokenizer.encode(p) for p in prompts], greedy)
    assert [o.prompt for o in by_text] == prompts
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    for out in by_text:
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
        assert out.finished and out.outputs[0].finish_reason == "length"


def test_stop_string_truncates_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("hello world", greedy)[0].outputs[0].text
    stop = full[5:10]  # spans a token boundary
    assert len(stop) == 5 and "\ufffd" not in full[:10]
    out = llm.generate("hello world",
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    assert not llm.engine.has_unfinished_requests()


def test_invalid_requests_raise_value_error_before_running(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["ok", "x" * 10], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=10**6)])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(["a", "b"], [SamplingParams()])
