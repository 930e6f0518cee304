"""The compiled CPU kernels beside the attention one: fused RMSNorm/RoPE, the bf16 small-batch linear, and the
allocator setting, each against the torch code it replaces; and a bf16 model through them vs all-torch."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from kernels.cpu import linear as cpu_linear
from kernels.cpu.build import load_kernel
from kernels.cpu.linear import load_small_batch_linear
from kernels.cpu.ops import load_cpu_ops
from tests.helpers import make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the CPU kernels cannot be built")
DTYPES = [torch.float32, torch.bfloat16]
ULP_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2 ** -7, "atol": 2 ** -7}}


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: split over threads
def test_rms_norm_and_residual_add_match_the_torch_layer(dtype, rows):
    ops, norm = load_cpu_ops(dtype), _norm(576, dtype)
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=g).to(dtype) for _ in range(2))
    out, res_out = ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref, ref_res = norm(x, residual)
    assert torch.equal(res_out, ref_res)  # the residual stream is one rounded add, bit for bit
    # the same rounding points; the squares are summed in another order, which can move a value across a
    # rounding boundary: one ulp of the dtype
    tol = ULP_TOL[dtype]
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x), **tol)


def test_rms_norm_reads_a_strided_row_view():
    ops, norm = load_cpu_ops(torch.float32), _norm(64, torch.float32)
    wide = torch.randn(5, 3 * 64)
    view = wide[:, 64:128]                       # rows 192 elements apart
    torch.testing.assert_close(ops.rms_norm(view, norm.weight, norm.eps), norm(view.contiguous()))


def _fused_qkv(tokens: int, hq: int, hkv: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tokens, (hq + 2 * hkv) * dim, generator=torch.Generator().manual_seed(3)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 77])  # 77: 16-lane chunks and a scalar tail
def test_silu_and_mul_matches_torch_to_rounding(dtype, inter):
    ops = load_cpu_ops(dtype)
    x = (torch.randn(40, 2 * inter, generator=torch.Generator().manual_seed(3)) * 6).to(dtype)
    x[0, :8] = torch.tensor([-200.0, -89.0, -20.0, 0.0, 20.0, 89.0, float("inf"), float("nan")])
    got = ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    # e^x computed 16 lanes at a time, to about 1 fp32 ulp: torch's own vectorized exp differs from libm's by as much
    torch.testing.assert_close(got[:, 8:], want[:, 8:], **ULP_TOL[dtype])
    # past e^-87 the exp is clamped (a value ~1e-35 where torch's underflows to 0); at large gate, gate * up
    torch.testing.assert_close(got[0, :6], want[0, :6], rtol=ULP_TOL[dtype]["rtol"], atol=1e-30)
    assert got[0, 6].isinf() and got[0, 7].isnan()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 33])
def test_rope_in_place_on_the_fused_qkv_equals_the_reference(dtype, tokens):
    hq, hkv, dim = 9, 3, 64
    rotary = RotaryEmbedding(dim, 4096, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    qkv = _fused_qkv(tokens, hq, hkv, dim, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    ref = rotary.rotate_qk(positions, qkv[:, :(hq + hkv) * dim].reshape(tokens, hq + hkv, dim))
    v_before = qkv[:, (hq + hkv) * dim:].clone()
    q = qkv[:, :hq * dim].reshape(tokens, hq, dim)
    k = qkv[:, hq * dim:(hq + hkv) * dim].reshape(tokens, hkv, dim)
    load_cpu_ops(dtype).apply_rope(q, k, positions, rotary.cos_sin_cache)
    assert torch.equal(qkv[:, :(hq + hkv) * dim].reshape(tokens, hq + hkv, dim), ref)  # bit for bit
    assert torch.equal(qkv[:, (hq + hkv) * dim:], v_before)                               # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_qk_norm_then_rope(dtype):
    hq, hkv, dim, tokens = 4, 2, 32, 6
    rotary = RotaryEmbedding(dim, 512, 1e6, None)
    q_norm, k_norm = _norm(dim, dtype), _norm(dim, dtype)
    k_norm.weight.data = k_norm.weight.data.flip(0)
    qkv = _fused_qkv(tokens, hq, hkv, dim, dtype)
    positions = torch.arange(100, 100 + tokens, dtype=torch.int32)
    q = qkv[:, :hq * dim].reshape(tokens, hq, dim)
    k = qkv[:, hq * dim:(hq + hkv) * dim].reshape(tokens, hkv, dim)
    ref_q, ref_k = rotary(positions, q_norm(q), k_norm(k))
    load_cpu_ops(dtype).qk_norm_rope(q, k, positions, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, 1e-5)
    torch.testing.assert_close(q, ref_q, **ULP_TOL[dtype])
    torch.testing.assert_close(k, ref_k, **ULP_TOL[dtype])


small_batch = load_small_batch_linear(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(small_batch is None, reason="this CPU has no AVX512_BF16")
small_batch_fp32 = load_small_batch_linear(torch.float32)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_equals_a_fp32_product_rounded_once(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    n, k = 103, 96                                   # a tail block of 3 rows; k: three AVX512_BF16 steps
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    assert small_batch.applies(x, w)
    got = small_batch(x, w, bias)
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # fp32 accumulation in another order, then one rounding to bf16: within one bf16 ulp of the exact product
    ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
    assert ((got.double() - exact).abs() <= ulp).all()
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1.6e-2, atol=1e-2)


@pytest.mark.skipif(small_batch_fp32 is None, reason="this CPU has no AVX-512")
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_fp32_equals_torch_to_rounding(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    n, k = 103, 80                                   # a tail block of 3 rows; k: five AVX-512 steps
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    assert small_batch_fp32.applies(x, w) and not small_batch_fp32.applies(x.bfloat16(), w.bfloat16())
    got = small_batch_fp32(x, w, bias)
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)     # fp32 sums in another order
    assert not small_batch_fp32.applies(torch.randn(rows, 40), torch.randn(n, 40))  # k % 16


@needs_bf16
def test_small_batch_linear_leaves_other_shapes_to_torch():
    w = torch.randn(8, 64).bfloat16()
    assert not small_batch.applies(torch.randn(cpu_linear.MAX_ROWS + 1, 64).bfloat16(), w)
    assert not small_batch.applies(torch.randn(2, 64), w.float())                      # fp32
    assert not small_batch.applies(torch.randn(2, 48).bfloat16(), torch.randn(8, 48).bfloat16())  # k % 32


FAULTS = """
import resource, sys, threading, torch
from engine.cpu_runtime import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
def step():  # one step's activations: several MB each, of varying sizes, freed before the next step
    for mb in (16, 12, 16, 8, 24, 12):
        torch.empty(mb << 18).fill_(1.0)
def steps():  # in a thread, as the engine loop runs them; the last step's page faults
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_activations_are_reused_without_page_faults():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    pages = (16 + 12 + 16 + 8 + 24 + 12) << 8     # 4 KiB pages one step touches
    assert faults("default") > pages // 8        # glibc's defaults hand blocks back: later steps fault again
    assert faults("tuned") < pages // 100        # kept in the process: reused


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v bias; qwen3: q/k norm
def test_bf16_model_through_the_cpu_kernels_matches_all_torch(checkpoints, arch):
    """Prefill and decode (small-batch linear, fused norm/RoPE, kernel-written K/V) vs the torch backend."""
    prompts = random_prompts(1000, [3, 17, 30], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(model=str(checkpoints[arch]), device="cpu", dtype="bfloat16", block_size=4,
                  attention_backend=backend)
        outs[backend] = llm.generate(prompts, params)
    kernels_used = small_batch is not None
    for ours, ref in zip(outs["cpu"], outs["torch"]):
        lps, ref_lps = ours.outputs[0].logprobs, ref.outputs[0].logprobs
        # bf16 rounding in another order may move a near-tie; up to the first difference the chosen tokens'
        # logprobs agree to bf16 precision
        for a, b in zip(lps, ref_lps):
            assert abs(a.logprob - b.logprob) < 0.05 + 0.02 * abs(b.logprob), (kernels_used, a, b)
            if a.token_id != b.token_id:
                break
        assert lps[0].token_id == ref_lps[0].token_id
