"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, fp32): greedy tokens
identical with and without it, for n-gram drafts (on a prompt that asks for a passage back, so most drafts are
accepted) and for a draft model (the same file as its own draft), alone and batched; through the server too."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.server.server_proc import ServerProcess

PASSAGE = (Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "perplexity.txt").read_text()[:900]
ASKS = ["Repeat the following text exactly, word for word:\n\n" + PASSAGE,
        "Copy this text, but in capital letters:\n\n" + PASSAGE[:400],
        "What is the capital of France?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MAX_LEN = 512


def chat_ids(llm: LLM, question: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]


def make_llm(path, spec=None) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8,
               speculative_config=spec)


@pytest.fixture(scope="module")
def reference(smollm2_file):
    llm = make_llm(smollm2_file)
    prompts = [chat_ids(llm, q) for q in ASKS]
    outs = llm.generate(prompts, GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identical(smollm2_file, reference, method):
    prompts, ref, _ = reference
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(smollm2_file),
                                            "num_speculative_tokens": 3}
    llm = make_llm(smollm2_file, spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref       # batched
    assert llm.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids == ref[0]           # alone
    c = llm.engine.spec.counters
    assert c.num_accepted_tokens > 0.5 * c.num_draft_tokens > 0     # the passage is copied: most drafts hold


def test_through_the_server(smollm2_file, reference):
    prompts, _, texts = reference
    proc = ServerProcess("--model", str(smollm2_file), "--device", "cpu", "--dtype", "float32", "--max-model-len",
                         str(MAX_LEN), "--speculative-config", str(NGRAM).replace("'", '"')).wait_ready()
    try:
        for prompt, text in zip(prompts, texts):
            r = httpx.post(f"{proc.base_url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 48, "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        assert "pagedserve_spec_decode_num_accepted_tokens_total" in metrics
    finally:
        proc.stop()
