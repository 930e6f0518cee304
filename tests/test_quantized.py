"""GGUF blocks computed with as they are (--quantization gguf): the CPU kernel against the `gguf` package's
dequantized reference per format, on quantized and random blocks and odd shapes; the loader keeping them.

Tolerances: dequantization is exact (the same float ops as the reference); the kernel's linear rounds each
32-value block of the input to int16 (scale max|x| / 32767), or where asked on CPUs with AVX-512 VNNI to int8
(max|x| / 127, llama.cpp's rounding), so it equals the product of the dequantized weight with that rounded
input to float32 summation error (1e-5 of the largest output), and the float product within 2e-4 (int16: the
rounding is at most 1/65534 of each block's max|x|) or 1e-2 (int8: 1/254) of the largest output.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams, loader
from engine.layers import quantized
from engine.layers.quantized import QuantizedWeight, QuantSegment, dequantize_reference, weight_nbytes
from kernels.cpu.quant import FORMATS, load_quant_kernel
from tests.gguf_files import random_blocks
from tests.helpers import int16_inputs_only

pytestmark = pytest.mark.skipif(load_quant_kernel() is None, reason="no C++ compiler: the CPU kernels cannot be built")
Q = gguf.GGMLQuantizationType


def quantized_blocks(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(values, Q[qtype]).view(np.uint8)))


K_QUANT_FORMATS = [q for q in FORMATS if FORMATS[q].block_weights == 256]
# (format, kind): the K-quants cannot be quantized by the gguf package, so only random super-blocks test them
CASES = [(q, kind) for q in FORMATS for kind in (("random",) if q in K_QUANT_FORMATS else ("quantized", "random"))]


def blocks_of(kind: str, qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    cols *= FORMATS[qtype].block_weights // 32     # K-quant rows are whole super-blocks of 256
    if kind == "quantized":
        return quantized_blocks(qtype, rows, cols, seed)
    return torch.from_numpy(np.ascontiguousarray(random_blocks(qtype, rows, cols, seed)))


def block_rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x as the kernel sees it: each block of 32 rounded to steps of max|x| / levels (32767: int16, 127: int8),
    by a multiply with the step's reciprocal as the kernel does (a division rounds some halves the other way)."""
    b = x.float().reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / levels
    return (torch.round(b * torch.where(d > 0, 1 / d, 0)) * d).reshape(x.shape)


def int16_rounded(x: torch.Tensor) -> torch.Tensor:
    return block_rounded(x, 32767)


@pytest.mark.parametrize("qtype,kind", CASES)
def test_dequantize_equals_the_gguf_package(qtype, kind):
    rows = 37
    blocks = blocks_of(kind, qtype, rows, 96, seed=1)
    cols = 96 * FORMATS[qtype].block_weights // 32
    ref = dequantize_reference(blocks, qtype, cols)
    kernel = load_quant_kernel()
    assert torch.equal(kernel.dequantize(blocks, qtype, cols, torch.float32), ref)
    assert torch.equal(kernel.dequantize(blocks, qtype, cols, torch.bfloat16), ref.bfloat16())
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(kernel.dequantize(blocks, qtype, cols, torch.float32, ids), ref[ids])


@pytest.mark.parametrize("qtype,kind", CASES)
@pytest.mark.parametrize("rows,cols,m", [(37, 96, 1), (5, 32, 3), (130, 544, 16)])
def test_linear_equals_the_dequantized_reference(qtype, kind, rows, cols, m):
    """Odd shapes: row counts that do not fill the kernel's tiles, 1 to 17 blocks (super-blocks) per row."""
    blocks = blocks_of(kind, qtype, rows, cols, seed=rows + m)
    cols *= FORMATS[qtype].block_weights // 32
    w = dequantize_reference(blocks, qtype, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    out = torch.full((m, rows), float("nan"))
    kernel = load_quant_kernel()
    kernel.linear_into(x, blocks, qtype, out, int8_inputs=True)
    scale = (x @ w.T).abs().max()
    int8 = kernel.has_int8
    exact = (block_rounded(x, 127 if int8 else 32767).double() @ w.double().T).float()
    assert (out - exact).abs().max() <= 1e-5 * scale
    assert (out - x @ w.T).abs().max() <= (1e-2 if int8 else 2e-4) * scale


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 16, 40])
def test_int16_inputs_when_int8_is_not_asked_for(qtype, m):
    """The LM head's path: every row rounded to int16, whatever the row count (int16 tiles or dot products)."""
    cols = 4 * FORMATS[qtype].block_weights
    blocks = blocks_of("random", qtype, 37, cols // (FORMATS[qtype].block_weights // 32), seed=m)
    w = dequantize_reference(blocks, qtype, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    out = torch.empty(m, 37)
    load_quant_kernel().linear_into(x, blocks, qtype, out, int8_inputs=False)
    exact = (int16_rounded(x).double() @ w.double().T).float()
    assert (out - exact).abs().max() <= 1e-5 * (x @ w.T).abs().max()


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(qtype, int8, dtype):
    """Bit for bit, whichever path the row count picks (dot products, tiles): a prompt prefilled whole and one
    continued from a cached prefix, or a request alone and in a batch, get the same numbers."""
    cols = 3 * FORMATS[qtype].block_weights
    blocks = blocks_of("random", qtype, 40, cols // (FORMATS[qtype].block_weights // 32), seed=5)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(6)).to(dtype)
    kernel = load_quant_kernel()
    whole = torch.empty(40, 40, dtype=dtype)
    kernel.linear_into(x, blocks, qtype, whole, int8_inputs=int8)
    for m0, m1 in [(0, 1), (3, 6), (10, 22), (7, 40)]:
        part = torch.empty(m1 - m0, 40, dtype=dtype)
        kernel.linear_into(x[m0:m1], blocks, qtype, part, int8_inputs=int8)
        assert torch.equal(part, whole[m0:m1]), (m0, m1)


needs_interleaved = pytest.mark.skipif(not getattr(load_quant_kernel(), "has_interleaved", False),
                                       reason="interleaved blocks are read by the AVX-512 VNNI build only")


# A block's bytes by kind, as the file stores them: fp16 fields, one-byte fields, quantized bytes (32-bit words).
BLOCK_FIELDS = {"Q4_0": ((0, 2), (2, 2), (2, 18)), "Q4_1": ((0, 4), (4, 4), (4, 20)), "Q8_0": ((0, 2), (2, 2), (2, 34)),
                "Q5_0": ((0, 2), (2, 2), (2, 22)), "Q5_1": ((0, 4), (4, 4), (4, 24)),
                "Q4_K": ((0, 4), (4, 16), (16, 144)), "Q5_K": ((0, 4), (4, 16), (16, 176)), "Q6_K": ((208, 210), (192, 208), (0, 192))}


def interleaved_reference(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """kernels/cpu/quant_x16.h's layout by torch: per group of 16 rows and block column, each field of the
    block for the 16 rows together: the fp16 fields (d; Q4_1's m; Q4_K's d and dmin), the one-byte fields (the
    K-quants' scale bytes), then the quantized bytes as 32-bit words, word j of the 16 rows together."""
    fmt = FORMATS[qtype]
    n, row_bytes = blocks.shape
    groups, cols = n // 16, row_bytes // fmt.block_bytes
    b = blocks.reshape(groups, 16, cols, fmt.block_bytes)
    parts = [b[..., lo:hi].reshape(groups, 16, cols, -1, width).permute(0, 2, 3, 1, 4).reshape(groups, cols, -1)
             for (lo, hi), width in zip(BLOCK_FIELDS[qtype], (2, 1, 4))]
    return torch.cat(parts, dim=2).reshape(n, row_bytes)


@needs_interleaved
@pytest.mark.parametrize("qtype,kind", [(q, k) for q in FORMATS for k in ("quantized", "random")
                                        if not (k == "quantized" and q.endswith("_K"))])   # gguf cannot quantize K
def test_interleaved_blocks_compute_what_the_files_layout_does(qtype, kind):
    """Interleaved in place as the layout says, the same dequantized rows, and bit for bit the same products
    at every row count and input rounding: one tile path serves them all, so a layout error cannot hide."""
    blocks = blocks_of(kind, qtype, 48, 7 * 32, seed=9)
    cols = 7 * FORMATS[qtype].block_weights
    kernel = load_quant_kernel()
    il = kernel.interleave_(blocks.clone(), qtype)
    assert torch.equal(il, interleaved_reference(blocks, qtype)) and not torch.equal(il, blocks)
    ref = dequantize_reference(blocks, qtype, cols)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(kernel.dequantize(il, qtype, cols, dtype, interleaved=True), ref.to(dtype))
    ids = torch.tensor([47, 0, 17, 17, 30])
    assert torch.equal(kernel.dequantize(il, qtype, cols, torch.float32, ids, interleaved=True), ref[ids])
    for m in (1, 2, 4, 5, 8, 13, 40):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        for int8, dtype in [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)]:
            want, got = torch.empty(m, 48, dtype=dtype), torch.empty(m, 48, dtype=dtype)
            kernel.linear_into(x.to(dtype), blocks, qtype, want, int8)
            kernel.linear_into(x.to(dtype), il, qtype, got, int8, interleaved=True)
            assert torch.equal(got, want), (m, int8, dtype)


@needs_interleaved
def test_only_what_the_kernel_reads_interleaved_is_interleaved():
    kernel = load_quant_kernel()
    with pytest.raises(ValueError, match="rejected"):      # 40 rows: not whole groups of 16
        kernel.linear_into(torch.randn(1, 64), quantized_blocks("Q4_1", 40, 64, 1), "Q4_1", torch.empty(1, 40),
                           interleaved=True)
    with pytest.raises(ValueError, match="cannot be interleaved"):
        kernel.interleave_(quantized_blocks("Q4_1", 40, 64, 1), "Q4_1")
    # a fused weight: whole groups of 16 rows in an interleavable format are interleaved, the rest kept as is;
    # a segment that is a view (rows of a larger tensor) is copied first, its base keeping the file's layout
    table = quantized_blocks("Q8_0", 48, 64, 2)
    weight = QuantizedWeight([QuantSegment("Q8_0", table[16:48]),
                              QuantSegment("Q4_1", quantized_blocks("Q4_1", 40, 64, 3))], 64)
    assert [s.interleaved for s in weight.segments] == [True, False]
    assert torch.equal(table, quantized_blocks("Q8_0", 48, 64, 2))
    x = torch.randn(3, 64)
    ref = torch.cat([dequantize_reference(table[16:48], "Q8_0", 64),
                     dequantize_reference(quantized_blocks("Q4_1", 40, 64, 3), "Q4_1", 64)])
    assert torch.equal(weight.dequantize(torch.float32), ref)
    assert (weight.linear(x, None) - x @ ref.T).abs().max() <= 2e-4 * (x @ ref.T).abs().max()


def test_linear_in_bf16_and_into_a_column_slice():
    blocks = quantized_blocks("Q4_1", 40, 64, seed=3)
    w = dequantize_reference(blocks, "Q4_1", 64)
    x = torch.randn(2, 64).bfloat16()
    out = torch.zeros(2, 50, dtype=torch.bfloat16)
    load_quant_kernel().linear_into(x, blocks, "Q4_1", out[:, 5:45])
    ref = x.float() @ w.T
    assert (out[:, 5:45].float() - ref).abs().max() <= 1e-2 * ref.abs().max()    # bf16 output rounding
    assert out[:, :5].eq(0).all() and out[:, 45:].eq(0).all()


@pytest.mark.parametrize("m", [1, quantized.MAX_KERNEL_ROWS + 1])
def test_bf16_inputs_give_fp32_outputs_when_asked(m):
    """The LM head's logits: the kernel's fp32 sums are kept, not rounded to bf16 (steps of 1/16 at |x| ~ 16)."""
    blocks = quantized_blocks("Q8_0", 40, 64, seed=7)
    qw = QuantizedWeight([QuantSegment("Q8_0", blocks)], 64)
    x = torch.randn(m, 64).bfloat16()
    out = qw.linear(x, None, torch.float32)
    ref = x.float() @ dequantize_reference(blocks, "Q8_0", 64).T
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() <= 2e-4 * ref.abs().max()     # the input rounding only, no bf16 output


@pytest.mark.parametrize("m", [0, 1, 7, quantized.MAX_KERNEL_ROWS + 1])
def test_fused_weight_of_two_formats(m):
    """q/k/v or gate/up fused from tensors stored in different formats: one segment each."""
    a, b = quantized_blocks("Q4_0", 24, 64, seed=4), quantized_blocks("Q8_0", 8, 64, seed=5)
    qw = QuantizedWeight([QuantSegment("Q4_0", a), QuantSegment("Q8_0", b)], 64)
    w = torch.cat([dequantize_reference(a, "Q4_0", 64), dequantize_reference(b, "Q8_0", 64)])
    assert qw.format == "Q4_0+Q8_0" and qw.nbytes == a.numel() + b.numel()
    assert torch.equal(qw.dequantize(torch.float32), w)
    x, bias = torch.randn(m, 64), torch.randn(32)
    ref, out = F.linear(x, w, bias), qw.linear(x, bias)
    assert out.shape == ref.shape
    assert m == 0 or (out - ref).abs().max() <= 2e-4 * ref.abs().max()


def test_blocks_that_do_not_fit_the_shape_are_refused():
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedWeight([QuantSegment("Q4_1", quantized_blocks("Q4_1", 4, 64, seed=6))], 96)
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedWeight([QuantSegment("Q6_K", torch.zeros(4, 210, dtype=torch.uint8))], 96)
    with pytest.raises(ValueError, match="cannot be computed"):
        QuantizedWeight([QuantSegment("Q2_K", torch.zeros(4, 84, dtype=torch.uint8))], 256)


def test_quantization_gguf_needs_a_gguf_file_on_cpu(tmp_path):
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        loader.resolve_quantization("gguf", tmp_path, torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        loader.resolve_quantization("gguf", tmp_path / "m.gguf", torch.device("cuda"))
    assert loader.resolve_quantization("auto", tmp_path / "m.gguf", torch.device("cpu")) == "gguf"
    assert loader.resolve_quantization("auto", tmp_path / "m.gguf", torch.device("cuda")) == "none"
    assert loader.resolve_quantization("auto", tmp_path, torch.device("cpu")) == "none"


# ------------------------------------------------------------------------------ the real default model
@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_file):
    return LLM(model=str(smollm2_file), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4,
               quantization="gguf")


def test_default_model_keeps_its_blocks(smollm2_gguf, smollm2_file):
    model = smollm2_gguf.engine.model
    layers = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
    assert {m.qweight.format for m in layers} == {"Q4_1", "Q8_0"}
    assert all(m.weight is None for m in layers)
    assert model.lm_head.qweight is model.embed_tokens.qweight       # tied: one Q8_0 table
    # with AVX-512 VNNI every segment is interleaved for the tiles (SmolLM2's row counts are multiples of 16)
    assert all(s.interleaved == load_quant_kernel().has_interleaved for m in layers for s in m.qweight.segments)
    assert weight_nbytes(model) <= 1.25 * smollm2_file.stat().st_size
    info = smollm2_gguf.engine.info      # what pagedserve_model_weight_bytes and /v1/stats report
    assert info.model_weight_bytes == weight_nbytes(model)
    assert info.weight_format == "Q4_1+Q8_0 blocks, float32 rest"


def test_model_weight_bytes_gauge():
    from prometheus_client import generate_latest

    from server.metrics import ServerMetrics

    metrics = ServerMetrics("m", 64)
    metrics.model_weight_bytes.set(123456789)
    assert 'pagedserve_model_weight_bytes{model_name="m"} 1.23456789e+08' in generate_latest(metrics.registry).decode()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_answers_the_readme_question(smollm2_gguf, smollm2_file, dtype):
    """Also in bf16 (what --dtype auto picks on AMX and AMD AVX512_BF16 CPUs): the first token is a near tie
    ("The" 0.08 ahead of "L" in fp32), which bf16-rounded logits turned into an exact tie."""
    llm = smollm2_gguf if dtype == "float32" else LLM(model=str(smollm2_file), device="cpu", dtype=dtype,
                                                       max_model_len=256, max_num_seqs=4, quantization="gguf")
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=16))
    assert out[0].outputs[0].text == "The capital of France is Paris."


# ------------------------------------------------------------------------------ tiny GGUF models, per format
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_inputs_are_rounded_to_int8_on_every_projection_and_the_lm_head(tmp_path, dtype):
    """With AVX-512 VNNI, bf16 activations reach every projection and the LM head as int8 (llama.cpp's
    rounding of every layer's inputs), fp32 ones as int16: each module's product equals the kernel's with
    that rounding asked for."""
    from engine.tiny_model import build_checkpoint
    from tests.gguf_files import write_gguf

    ckpt = build_checkpoint(tmp_path / "hf", "llama", seed=1, tie_word_embeddings=False)
    llm = LLM(model=str(write_gguf(ckpt, tmp_path / "m.gguf", "llama", "Q4_0")), device="cpu",
              dtype=str(dtype).removeprefix("torch."), max_model_len=64, quantization="gguf")
    model, kernel = llm.engine.model, load_quant_kernel()
    int8 = dtype == torch.bfloat16 and kernel.has_int8
    layer = model.layers[0]
    modules = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
               model.lm_head]
    for module in modules:
        q = module.qweight
        x = torch.randn(5, q.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        got = module(x)
        want = torch.empty(5, q.out_features, dtype=got.dtype)
        col = 0
        for seg in q.segments:
            n = seg.blocks.shape[0]
            kernel.linear_into(x, seg.blocks, seg.qtype, want[:, col:col + n], int8, seg.interleaved)
            col += n
        assert torch.equal(got, want[:, :got.shape[1]]), module     # the LM head cuts vocabulary padding


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_model_from_blocks_scores_as_the_dequantized_model(tmp_path, qtype):
    """A whole model computed from its blocks (decode rows and prefill rows) against the same file dequantized
    at load, every input rounded to int16 (tests.helpers.int16_inputs_only): the log-probabilities agree to 1e-3
    of their range, through a random model whose log-probabilities reach -100 (a wrong block layout is off by
    tens)."""
    from engine.tiny_model import build_checkpoint
    from tests.gguf_files import K_QUANTS, write_gguf

    k_dims = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64} if qtype in K_QUANTS else {}
    ckpt = build_checkpoint(tmp_path / "hf", "llama", seed=1, tie_word_embeddings=False, **k_dims)
    path = write_gguf(ckpt, tmp_path / f"m-{qtype}.gguf", "llama", qtype)
    prompt = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, logprobs=1)
    scored = {}
    for mode in ("gguf", "none"):
        llm = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=128, quantization=mode)
        if mode == "gguf":
            int16_inputs_only(llm)
            model = llm.engine.model
            assert {m.qweight.format for m in model.modules() if getattr(m, "qweight", None) is not None} == {qtype}
        out = llm.generate([prompt], params)[0]
        scored[mode] = [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in out.outputs[0].logprobs]
        del llm
    got, ref = torch.tensor(scored["gguf"]), torch.tensor(scored["none"])
    assert ref.std() > 0.05      # the model's distribution is not flat: a wrong layout would show
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()
