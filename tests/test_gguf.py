"""GGUF files: dequantization, Q/K un-permutation, config, tokenizer, and token parity with transformers
reading the same file."""
from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import LLM, SamplingParams
from engine.default_model import resolve
from engine.gguf_loader import hf_config, load_tokenizer, open_gguf
from engine.loader import _empty_model, load_tensors
from engine.tiny_model import build_checkpoint
from tests.gguf_files import BAD_CASES, K_QUANTS, WRITABLE, bad_gguf_files, random_blocks, torch_dequantize, write_gguf
from tests.helpers import hf_greedy, hf_model, random_prompts

MAX_TOKENS = 12
# K-quant blocks hold 256 values: their rows must be multiples of 256 long.
K_DIMS = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
ARCH_OVERRIDES = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    # head_dim != hidden_size / heads: the file's attention.key_length must be honoured
    "qwen3": {"tie_word_embeddings": True, "head_dim": 32},
}
CASES = ([("llama", q) for q in WRITABLE] + [("qwen2", "Q8_0"), ("qwen2", "F16"), ("qwen3", "F32"),
         ("qwen3", "Q4_1")] + [("llama", q) for q in K_QUANTS] + [("qwen3", "Q6_K")])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@cache
def _checkpoint(root: Path, arch: str, k_dims: bool) -> Path:
    overrides = {**ARCH_OVERRIDES[arch], **(K_DIMS if k_dims else {})}
    return build_checkpoint(root / f"{arch}-hf{'-k' if k_dims else ''}", arch, seed=1, **overrides)


def gguf_file(root: Path, arch: str, qtype: str) -> Path:
    path = root / f"{arch}-{qtype}.gguf"
    if not path.is_file():
        write_gguf(_checkpoint(root, arch, qtype in K_QUANTS), path, arch, qtype)
    return path


# transformers' torch dequantizer covers these block formats; F16/BF16 are plain values torch can view
TORCH_DEQUANT = ("Q8_0", "Q4_0", "Q4_1", *K_QUANTS)


def _random_data(qtype: str) -> tuple[np.ndarray | None, np.ndarray]:
    """(the float values quantized, or None for random K-quant blocks; the stored bytes)"""
    if qtype in K_QUANTS:
        return None, random_blocks(qtype, 8, 512, seed=7)
    values = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    return values, gguf.quants.quantize(values, Q[qtype]).view(np.uint8)


@pytest.mark.parametrize("qtype", TORCH_DEQUANT + ("F16", "BF16"))
def test_gguf_dequantization_equals_an_independent_implementation(qtype):
    """gguf.quants and transformers' torch dequantizer (or torch's own float16/bfloat16) agree."""
    _, data = _random_data(qtype)
    ours = torch.from_numpy(gguf.quants.dequantize(data, Q[qtype]))
    if qtype in TORCH_DEQUANT:
        theirs = torch_dequantize(data, qtype).float().reshape(ours.shape)
    else:
        theirs = torch.from_numpy(data.copy()).view(getattr(torch, {"F16": "float16", "BF16": "bfloat16"}[qtype]))
    assert ours.shape == (8, 512) and torch.isfinite(ours).all() and ours.abs().sum() > 0
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [q for q in WRITABLE if q != "F32"])
def test_quantize_dequantize_round_trip_is_within_one_step(qtype):
    values, data = _random_data(qtype)
    back = gguf.quants.dequantize(data, Q[qtype])
    bits = {"F16": 11, "BF16": 8, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}[qtype]
    blocks = np.abs(values).reshape(8, -1, 32).max(-1, keepdims=True)   # per-32-value block scale
    step = np.broadcast_to(2 * blocks / 2 ** bits, (8, 16, 32)).reshape(8, 512)
    assert np.all(np.abs(back - values) <= step + 1e-6)


@pytest.mark.parametrize("arch,qtype", CASES)
def test_weights_and_greedy_tokens_equal_transformers(root, arch, qtype):
    path = gguf_file(root, arch, qtype)
    # the dequantized path (--quantization none); tests/test_quantized.py covers the blocks kept as they are
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=4, max_model_len=128, quantization="none")
    hf = hf_model(str(path))
    # transformers' tensors, fused by our own loader, must be our tensors bit for bit
    ref = _empty_model(llm.engine.model_config, torch.float32, torch.device("cpu"), 128)
    load_tensors(ref, hf.state_dict().items())
    ours = llm.engine.model.state_dict()     # tied lm_head included
    assert ours.keys() == ref.state_dict().keys()
    for name, param in ref.state_dict().items():
        assert torch.equal(ours[name], param), name
    prompts = random_prompts(1000, [1, 9, 23], seed=len(qtype))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_equals_transformers_gguf_config(root, arch):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = gguf_file(root, arch, "F16")
    ours = hf_config(open_gguf(path))
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    theirs.pop("_model_name_or_path")
    assert {k: ours.get(k) for k in theirs} == theirs
    assert ours["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert ours["head_dim"] == ARCH_OVERRIDES[arch].get("head_dim", 16)


def test_tokenizer_from_gguf_equals_the_checkpoints(root):
    from transformers import AutoTokenizer

    path = gguf_file(root, "llama", "F16")
    ours, original = load_tokenizer(path), AutoTokenizer.from_pretrained(str(_checkpoint(root, "llama", False)))
    for text in ["Hello world", "  two  spaces\nand a line", "naïve café ☕ 東京", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == original.encode(text), text
    chat = [{"role": "user", "content": "What is two plus two?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ours.eos_token == "<|endoftext|>" and ours.decode(ours.encode("a <|im_end|>"),
                                                             skip_special_tokens=True) == "a "


def test_served_name_is_the_file_name_without_gguf(root):
    path = gguf_file(root, "llama", "Q8_0")
    assert resolve(str(path)).name == "llama-Q8_0"
    assert LLM(model=str(path), device="cpu", max_model_len=64).engine.model_name == "llama-Q8_0"


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_gguf_files_raise_one_clear_value_error(root, case):
    path, pattern = bad_gguf_files(root, gguf_file(root, "llama", "F16"))[case]
    with pytest.raises(ValueError, match=pattern) as info:
        LLM(model=str(path), device="cpu")
    assert "\n" not in str(info.value)


def test_a_type_only_the_reference_dequantizer_reads_needs_quantization_none(root, tmp_path):
    """MXFP4 has no block kernel: the default refuses it naming --quantization none, which dequantizes it
    with gguf's reference dequantizer into the same weights as a float checkpoint of the round-tripped values."""
    from safetensors.torch import load_file, save_file
    ckpt = _checkpoint(root, "llama", False)
    path = write_gguf(ckpt, tmp_path / "llama-MXFP4.gguf", "llama", "MXFP4")
    with pytest.raises(ValueError, match="stored as MXFP4, a type the quantized CPU path .* --quantization none"):
        LLM(model=str(path), device="cpu")
    rounded = tmp_path / "rounded-hf"
    shutil.copytree(ckpt, rounded)
    tensors = load_file(str(ckpt / "model.safetensors"))
    for name, t in tensors.items():
        if t.ndim == 2:
            values = gguf.quants.quantize(t.float().numpy(), Q.MXFP4)
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(values, Q.MXFP4).copy())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(rounded / "model.safetensors"))
    kw = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128)
    ours = LLM(model=str(path), quantization="none", **kw)
    ref = LLM(model=str(rounded), **kw)
    ref_state = ref.engine.model.state_dict()
    for name, param in ours.engine.model.state_dict().items():
        assert torch.equal(param, ref_state[name]), name
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = random_prompts(1000, [3, 17], seed=5)
    assert ([o.outputs[0].token_ids for o in ours.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])


def test_upper_case_extension_dispatches_to_gguf(root, tmp_path):
    upper = tmp_path / "Model.GGUF"
    shutil.copyfile(gguf_file(root, "llama", "Q8_0"), upper)
    assert LLM(model=str(upper), device="cpu", max_model_len=64).engine.model_name == "Model"
