"""Shared test helpers: tiny checkpoints and a transformers reference."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from engine.layers.linear import LinearBase
from engine.tiny_model import build_checkpoint

# One flavour per supported architecture, each exercising its distinguishing feature.
ARCH_OVERRIDES = {
    "llama": dict(tie_word_embeddings=False, max_position_embeddings=512,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True),
}


def make_checkpoint(root: Path, arch: str, **overrides) -> Path:
    return build_checkpoint(root / arch, arch, seed=1, **{**ARCH_OVERRIDES[arch], **overrides})


@lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    if path.endswith(".gguf"):
        return hf_gguf_model(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_gguf_model(path: str):
    """transformers reading a GGUF file itself: its own dequantization and Q/K un-permutation. Its config
    mapping drops qwen3's head_dim (it takes Qwen3Config's default 128), so a qwen3 file gets the config
    we read; tests/test_gguf.py compares that config with transformers' own for every other key."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.gguf_loader import hf_config, open_gguf

    file = Path(path)
    config = hf_config(open_gguf(file))
    kwargs = {"config": AutoConfig.for_model(**config)} if config["model_type"] == "qwen3" else {}
    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                **kwargs).eval()


@torch.inference_mode()
def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation with eos ignored (not masked: generate's min_new_tokens would
    mask it), and the log-probability of each chosen token."""
    return greedy_of(hf_model(str(path)), prompt, max_new_tokens)


@torch.inference_mode()
def greedy_of(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """A transformers (or peft) causal LM's greedy continuation, as hf_greedy."""
    ids = list(prompt)
    tokens, logprobs = [], []
    past = None
    step_input = torch.tensor([ids])
    for _ in range(max_new_tokens):
        out = model(step_input, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logp = torch.log_softmax(out.logits[0, -1].float(), -1)
        tok = int(logp.argmax())
        tokens.append(tok)
        logprobs.append(logp[tok].item())
        step_input = torch.tensor([[tok]])
    return tokens, logprobs


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # skip the special tokens (ids 0..2) so no prompt contains an eos
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]



def int16_inputs_only(llm) -> None:
    """Rounds every input of a model computed from blocks to int16 (with AVX-512 VNNI bf16 inputs are int8 by
    default: llama.cpp's rounding, LinearBase.int8_for), so that it scores as the dequantized weights do to
    1e-3 and a wrong block layout cannot hide in int8 noise; tests/test_quantized.py checks the int8 path's
    products against their exact reference."""
    for module in llm.engine.model.modules():
        if isinstance(module, LinearBase):
            module.int8_inputs = False
    if llm.engine.model.native is not None:
        llm.engine.model.native.reset()
