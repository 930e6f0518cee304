"""Speculative decoding on the GPU path (Triton attention, CUDA graphs for the decode steps; verify steps, which
have several query tokens per sequence, run eagerly): greedy fp32 tokens equal decoding without it, for n-gram
and draft-model drafts, in a batch of mixed lengths. Run: pytest tests/gpu -q"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identical_on_cuda(tmp_path, method):
    target = make_checkpoint(tmp_path, "qwen3", num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, intermediate_size=512)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "draft_model":
        draft = make_checkpoint(tmp_path / "draft", "qwen3", num_hidden_layers=1, hidden_size=256,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    prompts = [p + p[: len(p) // 2] for p in random_prompts(1000, [5, 40, 17, 9, 33, 2, 60, 11], seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = LLM(model=str(target), device="cuda", dtype="float32").generate(prompts, params)
    llm = LLM(model=str(target), device="cuda", dtype="float32", speculative_config=spec)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert llm.engine.spec.counters.num_drafts > 0
