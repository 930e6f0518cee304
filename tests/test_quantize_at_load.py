"""--quantization q8_0 / q4_0: a float checkpoint's linear layers and embedding table become GGUF blocks at
load (llama.cpp's rounding, by the gguf package), computed by the CPU kernel; also split over two ranks.

The reference is the same checkpoint with every quantized weight replaced by its quantize -> dequantize
round trip, served as floats: the blocks then hold exactly those weights, and the kernel's only other
difference is its int16 rounding of the inputs (1e-3 of the scores' range, as in tests/test_quantized.py).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams, loader
from engine.layers.quantized import weight_nbytes
from kernels.cpu.quant import load_quant_kernel
from tests.helpers import int16_inputs_only, make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(load_quant_kernel() is None, reason="no C++ compiler: the CPU kernels cannot be built")


def round_tripped(src, dst, qtype: str):
    """A copy of checkpoint src whose 2-D weights went through qtype blocks and back."""
    import shutil
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.dim() == 2 and t.shape[1] % 32 == 0:
                q = gguf.GGMLQuantizationType[qtype]
                values = gguf.quants.dequantize(gguf.quants.quantize(t.float().numpy(), q), q)
                tensors[name] = torch.from_numpy(np.array(values, dtype=np.float32)).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def scores(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, logprobs=1))[0]
    return torch.tensor([e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in out.outputs[0].logprobs])


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("llama", "Q4_0"), ("qwen3", "Q8_0")])
def test_quantized_at_load_scores_as_its_round_trip(tmp_path, arch, qtype):
    ckpt = make_checkpoint(tmp_path, arch)
    ref_ckpt = round_tripped(ckpt, tmp_path / "round-trip", qtype)
    prompt = random_prompts(1000, [30], seed=3)[0]
    llm = LLM(model=str(ckpt), device="cpu", dtype="float32", max_model_len=128, quantization=qtype.lower())
    model = llm.engine.model
    formats = {m.qweight.format for m in model.modules() if getattr(m, "qweight", None) is not None}
    assert formats == {qtype}
    assert all(getattr(m, "weight", None) is None for m in model.modules() if getattr(m, "qweight", None) is not None)
    if model.config.tie_word_embeddings:
        assert model.lm_head.qweight is model.embed_tokens.qweight
    float_bytes = weight_nbytes(LLM(model=str(ckpt), device="cpu", dtype="float32", max_model_len=128).engine.model)
    assert llm.engine.info.model_weight_bytes < float_bytes * (0.35 if qtype == "Q8_0" else 0.2)
    int16_inputs_only(llm)      # int8 noise would hide a layout error; the int8 products: test_quantized.py
    got = scores(llm, prompt)
    ref = scores(LLM(model=str(ref_ckpt), device="cpu", dtype="float32", max_model_len=128), prompt)
    assert ref.std() > 0.05
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_two_ranks_hold_half_the_blocks_and_match_one(tmp_path):
    ckpt = make_checkpoint(tmp_path, "llama")
    prompts = random_prompts(1000, [30, 7, 19], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_model_len=128, quantization="q8_0")
    single = LLM(model=str(ckpt), **kw)
    ref = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    one_rank_bytes = single.engine.info.model_weight_bytes
    with LLM(model=str(ckpt), tensor_parallel_size=2, **kw) as llm:
        model = llm.engine.model
        assert model.layers[0].mlp.down_proj.qweight.in_features * 2 == \
            single.engine.model.layers[0].mlp.down_proj.qweight.in_features
        # all ranks summed: the same blocks as one rank, plus the padded vocabulary's rows
        assert one_rank_bytes <= llm.engine.info.model_weight_bytes <= one_rank_bytes * 1.1
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref


def test_quantizing_at_load_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match="keeps its own blocks"):
        loader.resolve_quantization("q8_0", tmp_path / "m.gguf", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        loader.resolve_quantization("q4_0", tmp_path, torch.device("cuda"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model="tiny-random", device="cpu", quantization="q3_k")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_two_ranks_of_a_gguf_file_hold_their_slice_of_the_blocks(tmp_path, qtype):
    from engine.tiny_model import build_checkpoint
    from tests.gguf_files import write_gguf

    k_dims = {"hidden_size": 512, "intermediate_size": 1024, "head_dim": 128} if qtype == "Q4_K" else {}
    ckpt = build_checkpoint(tmp_path / "hf", "llama", seed=1, tie_word_embeddings=False, **k_dims)
    path = write_gguf(ckpt, tmp_path / f"m-{qtype}.gguf", "llama", qtype)
    prompts = random_prompts(1000, [30, 7], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    kw = dict(device="cpu", dtype="float32", max_model_len=128, quantization="gguf")
    single = LLM(model=str(path), **kw)
    ref = single.generate(prompts, params)
    with LLM(model=str(path), tensor_parallel_size=2, **kw) as llm:
        down = llm.engine.model.layers[0].mlp.down_proj.qweight
        assert down.format == qtype
        assert down.in_features * 2 == single.engine.model.layers[0].mlp.down_proj.qweight.in_features
        got = llm.generate(prompts, params)
    for r, o in zip(ref, got):
        a = torch.tensor([e.logprob for e in r.prompt_logprobs[1:]])
        b = torch.tensor([e.logprob for e in o.prompt_logprobs[1:]])
        assert (a - b).abs().max() <= 1e-3 * a.abs().max()
