"""Quantized decoder layers in one native call each (engine/layers/native_decoder.py): the same tokens and
log-probabilities, bit for bit, as the torch modules calling the same kernels one by one; in mixed prefill +
decode batches, with chunked prefill and prefix hits; the modules still take what it does not."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.native_decoder import NativeDecoder
from kernels.cpu.layer import load_layer_kernel
from tests.helpers import random_prompts

pytestmark = pytest.mark.skipif(load_layer_kernel() is None, reason="no C++ compiler: the CPU kernels cannot be built")


def gguf_model(tmp_path, arch: str, qtype: str):
    from engine.tiny_model import build_checkpoint
    from tests.gguf_files import K_QUANTS, write_gguf

    k_dims = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64} if qtype in K_QUANTS else {}
    ckpt = build_checkpoint(tmp_path / f"{arch}-hf", arch, seed=1, tie_word_embeddings=False, **k_dims)
    return write_gguf(ckpt, tmp_path / f"{arch}-{qtype}.gguf", arch, qtype)


def run(path, native: bool, dtype: str, prompts, **kw):
    llm = LLM(model=str(path), device="cpu", dtype=dtype, block_size=4, max_model_len=256, quantization="gguf",
              **kw)
    model = llm.engine.model
    assert model.native is not None
    if not native:
        model.native = None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    # a prefix hit: only the tail is computed (prompt logprobs would recompute the prompt)
    again = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2))[0]
    assert again.num_cached_tokens > 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs + [again]]


@pytest.mark.parametrize("arch,qtype,dtype", [("llama", "Q4_1", "float32"), ("qwen3", "Q8_0", "float32"),
                                              ("llama", "Q4_K", "bfloat16")])
def test_native_layers_equal_the_modules_bit_for_bit(tmp_path, arch, qtype, dtype):
    path = gguf_model(tmp_path, arch, qtype)
    prompts = random_prompts(1000, [30, 3, 17, 9], seed=7)
    # a 16-token budget: prefill chunks beside decode rows in one step
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4)
    assert run(path, True, dtype, prompts, **kw) == run(path, False, dtype, prompts, **kw)


def test_steps_of_more_rows_than_the_kernel_serves_take_the_modules(tmp_path):
    path = gguf_model(tmp_path, "llama", "Q8_0")
    prompts = random_prompts(1000, [200, 150], seed=8)       # one 350-token prefill step: dequantized GEMMs
    assert run(path, True, "float32", prompts) == run(path, False, "float32", prompts)


def test_float_weights_and_two_ranks_keep_the_modules(tmp_path):
    from tests.helpers import make_checkpoint

    llm = LLM(model=str(make_checkpoint(tmp_path, "llama")), device="cpu", dtype="float32", max_model_len=64)
    assert llm.engine.model.native is None
    path = gguf_model(tmp_path, "llama", "Q8_0")
    with LLM(model=str(path), device="cpu", dtype="float32", max_model_len=64, tensor_parallel_size=2) as tp:
        assert tp.engine.model.native is None
        assert tp.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_supports_needs_every_projection_in_blocks(tmp_path):
    path = gguf_model(tmp_path, "llama", "Q8_0")
    model = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=64).engine.model
    assert NativeDecoder.supports(model)
    model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(model.config.hidden_size))
    assert not NativeDecoder.supports(model)
