"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 30 layers, GQA group 3, head_dim 64), on CPU in
fp32: config and tokenizer as transformers reads them; dequantized at load (--quantization none), greedy tokens
equal to transformers' on the same file alone, in one batch, with chunked prefill and with prefix-cache hits;
computed from its blocks (the default), the README's answer and a perplexity within 1% of transformers' (int8
rounding of some inputs, as llama.cpp rounds them, moves near-tied greedy tokens: tests/test_quantized.py
checks the kernels against their exact references); and the Triton kernels (interpreted) equal to the torch
backend."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, default_model
from engine.default_model import DEFAULT_MODEL, INSTALL_HINT, resolve
from tests.conftest import SMOLLM2_MAX_MODEL_LEN
from tests.helpers import hf_greedy

MAX_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue? Answer in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a black cat.",
    "Explain what a CPU does to a child, briefly, in two short and simple sentences please.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def chat_ids(llm: LLM, question: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def smollm2_float(smollm2_file) -> LLM:
    """The file dequantized at load into fp32: what transformers computes with."""
    return LLM(model=str(smollm2_file), device="cpu", dtype="float32", max_model_len=SMOLLM2_MAX_MODEL_LEN,
               max_num_seqs=8, block_size=16, quantization="none")


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return [chat_ids(smollm2, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm2_file, prompts) -> list[list[int]]:
    """transformers' greedy tokens on the same GGUF file (its own GGUF loading), eos ignored."""
    return [hf_greedy(smollm2_file, p, MAX_TOKENS)[0] for p in prompts]


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_default_model_is_the_installed_smollm2(smollm2_file):
    resolved = resolve(DEFAULT_MODEL)
    assert resolved.path == smollm2_file and resolved.name == "SmolLM2-135M-Instruct"


def test_default_falls_back_to_tiny_random_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(default_model, "default_model_file", lambda: None)
    with caplog.at_level(logging.WARNING, logger="engine.default_model"):
        resolved = resolve(DEFAULT_MODEL)
    assert resolved.name == "tiny-random" and (resolved.path / "config.json").is_file()
    [record] = caplog.records
    assert INSTALL_HINT in record.getMessage() and "tiny-random" in record.getMessage()


def test_config_tokenizer_and_eos_as_transformers_reads_them(smollm2, smollm2_file):
    from transformers import AutoTokenizer

    cfg = smollm2.engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64, 1536, 49152, True, 100000.0)
    theirs = AutoTokenizer.from_pretrained(str(smollm2_file.parent), gguf_file=smollm2_file.name)
    ours = smollm2.tokenizer
    for text in ["Hello world!", "  spaces\tand\nlines", "naïve café ☕ 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text), text
    chat = [{"role": "user", "content": QUESTIONS[0]}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert smollm2.engine.eos_token_ids == [theirs.convert_tokens_to_ids("<|im_end|>")]


def test_greedy_alone_equals_transformers(smollm2_float, prompts, reference):
    for prompt, ref in zip(prompts, reference):
        [out] = smollm2_float.generate([prompt], GREEDY)
        assert out.outputs[0].token_ids == ref
    assert_no_leaks(smollm2_float)


def test_greedy_in_one_batch_with_prefix_hits_equals_transformers(smollm2_float, prompts, reference):
    # The prompts share the chat template's system prompt, and the alone runs left its blocks cached.
    llm = smollm2_float
    hits = llm.engine.block_manager.prefix_hits
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.block_manager.prefix_hits > hits and all(o.num_cached_tokens >= 16 for o in outs)
    assert_no_leaks(llm)


def test_chunked_prefill_equals_transformers(smollm2_file, prompts, reference):
    llm = LLM(model=str(smollm2_file), device="cpu", dtype="float32", max_model_len=SMOLLM2_MAX_MODEL_LEN,
              max_num_seqs=8, block_size=16, max_num_batched_tokens=24, enable_prefix_caching=False,
              quantization="none")
    assert min(len(p) for p in prompts) > 24        # every prompt is prefilled in several chunks
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_no_leaks(llm)


@torch.inference_mode()
def test_blocks_perplexity_within_one_percent_of_transformers(smollm2, smollm2_file):
    """The first 240 tokens of benchmarks/data/perplexity.txt (English prose) scored from the blocks against
    transformers on the same file: in fp32 (inputs rounded to int16) prefilled whole and in chunks of 7 tokens,
    and in bf16 (inputs rounded to int8 where the CPU has AVX-512 VNNI: --dtype auto's choice there)."""
    from tests.helpers import hf_model

    text = (Path(__file__).parent.parent / "benchmarks" / "data" / "perplexity.txt").read_text()
    ids = smollm2.tokenizer.encode(text)[:240]
    logits = hf_model(str(smollm2_file))(torch.tensor([ids])).logits[0, :-1].float()
    ref = math.exp(-torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).mean().item())
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    chunked = LLM(model=str(smollm2_file), device="cpu", dtype="float32", max_model_len=SMOLLM2_MAX_MODEL_LEN,
                  max_num_batched_tokens=7, enable_prefix_caching=False)
    bf16 = LLM(model=str(smollm2_file), device="cpu", dtype="bfloat16", max_model_len=SMOLLM2_MAX_MODEL_LEN,
               enable_prefix_caching=False)
    for llm in (smollm2, chunked, bf16):
        [out] = llm.generate([ids], params)
        got = math.exp(-sum(e.logprob for e in out.prompt_logprobs[1:]) / (len(ids) - 1))
        assert abs(got / ref - 1) <= 0.01, (got, ref)


def test_capital_of_france(smollm2):
    [out] = smollm2.generate([chat_ids(smollm2, QUESTIONS[0])], SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


def test_triton_backend_interpreted_equals_torch_backend(smollm2_file, smollm2):
    """GQA group 3 and head_dim 64 through the Triton kernels (TRITON_INTERPRET=1 on CPU: slow, so short)."""
    llm = LLM(model=str(smollm2_file), device="cpu", dtype="float32", attention_backend="triton",
              max_model_len=64, max_num_seqs=2, block_size=16)
    prompt = smollm2.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    start = time.monotonic()
    [ours] = llm.generate([prompt], params)
    logging.getLogger(__name__).info("triton (interpreted): %.1f s", time.monotonic() - start)
    assert ours.outputs[0].token_ids == smollm2.generate([prompt], params)[0].outputs[0].token_ids
