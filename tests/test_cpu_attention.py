"""CpuAttentionBackend (compiled kernel reading the paged cache in place) == the torch reference backend."""
from __future__ import annotations

import pytest
import torch

from engine.attention.cpu import CpuAttentionBackend
from engine.attention.torch_ref import TorchAttentionBackend
from kernels.cpu.build import load_kernel
from tests.kernels.paged_cases import EngineBatch, make_engine_batch

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the CPU kernel cannot be built")

HEAD_DIM = 64


def _batch(pairs, num_heads, num_kv_heads, block_size, dtype=torch.float32, pad_rows=0, head_dim=HEAD_DIM):
    return make_engine_batch(pairs, num_heads, num_kv_heads, head_dim, block_size, seed=len(pairs) + block_size,
                             pad_rows=pad_rows, dtype=dtype, device="cpu")


def assert_matches_reference(batch: EngineBatch, tol: float) -> None:
    """Same cache writes (bit for bit) and the same attention output as the torch reference. The kernel gets
    the NaN-poisoned cache, so a read of any slot a sequence does not own shows up as NaN."""
    q, k, v, k_cache, v_cache, meta = batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta
    scale = q.shape[-1] ** -0.5
    kc_ref, vc_ref = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    backend = CpuAttentionBackend()
    assert backend.kernel is not None
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, meta, scale)
    assert torch.equal(k_cache.nan_to_num(0.0), kc_ref)
    assert torch.equal(v_cache.nan_to_num(0.0), vc_ref)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_only_batch_gqa_group_3(block_size):
    # SmolLM2's shape: 9 query heads over 3 KV heads; contexts crossing block and chunk boundaries
    batch = _batch([(0, 1), (15, 1), (16, 1), (37, 1), (200, 1)], 9, 3, block_size)
    assert batch.meta.is_decode_only
    assert_matches_reference(batch, 1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_with_chunked_prefill_and_prefix_hits(block_size):
    # fresh prompt, chunk after a cached prefix (chunked prefill), a prefix-cache hit of whole blocks
    # followed by its uncached tail, a long chunk spanning several query tiles, and decode rows
    pairs = [(0, 9), (12, 7), (2 * block_size, 3), (5, 1), (70, 45), (33, 1), (0, 130)]
    assert_matches_reference(_batch(pairs, 9, 3, block_size), 1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (8, 2, 128), (6, 1, 48)])
def test_other_head_shapes(num_heads, num_kv_heads, head_dim):
    # MHA, group 4 with head_dim 128, MQA with a head_dim that is not a multiple of 16 (scalar path)
    batch = _batch([(0, 5), (20, 1), (9, 3)], num_heads, num_kv_heads, 16, head_dim=head_dim)
    assert_matches_reference(batch, 1e-5)


def test_padding_rows_are_zero():
    batch = _batch([(7, 1), (30, 1)], 9, 3, 16, pad_rows=2)
    out = CpuAttentionBackend().forward(*batch.args(HEAD_DIM ** -0.5))
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert_matches_reference(_batch([(7, 1), (30, 1)], 9, 3, 16, pad_rows=2), 1e-5)


def test_bfloat16_accumulates_in_fp32():
    batch = _batch([(0, 20), (50, 1), (33, 6)], 9, 3, 16, dtype=torch.bfloat16)
    assert_matches_reference(batch, 2e-2)


def test_unsupported_dtype_falls_back_to_the_reference():
    batch = _batch([(0, 4), (10, 1)], 4, 2, 16, dtype=torch.float16)
    assert_matches_reference(batch, 1e-3)


@pytest.mark.parametrize("vendor,flags,expected", [
    ("GenuineIntel", "avx512f avx512_bf16 amx_bf16 amx_tile", "bfloat16"),
    ("GenuineIntel", "avx512f avx512_bf16", "float32"),
    ("AuthenticAMD", "avx512f avx512_bf16", "bfloat16"),
    ("AuthenticAMD", "avx2 fma", "float32"),
    ("GenuineIntel", "avx2 fma", "float32"),
])
def test_auto_dtype_per_cpu_kind(vendor, flags, expected):
    from engine.cpu_dtype import CpuKind, auto_dtype

    dtype, why = auto_dtype(CpuKind(vendor, frozenset(flags.split())))
    assert dtype == expected and why


@pytest.mark.parametrize("vendor,flags,expected", [
    ("AuthenticAMD", "avx512f avx512_bf16 avx512_vnni", "bfloat16"),
    ("GenuineIntel", "avx512f avx512_bf16 avx512_vnni", "bfloat16"),
    ("GenuineIntel", "avx512f avx512_vnni", "float32"),
    ("AuthenticAMD", "avx2 fma", "float32"),
])
def test_auto_dtype_of_quantized_blocks_per_cpu_kind(vendor, flags, expected):
    from engine.cpu_dtype import CpuKind, auto_blocks_dtype

    dtype, why = auto_blocks_dtype(CpuKind(vendor, frozenset(flags.split())))
    assert dtype == expected and why


def test_auto_dtype_and_backend_on_cpu():
    from engine.config import EngineConfig
    from engine.cpu_dtype import auto_blocks_dtype, auto_dtype, this_cpu

    cfg = EngineConfig(model="tiny-random", device="cpu").resolved()
    assert (cfg.dtype, cfg.attention_backend) == (auto_dtype(this_cpu())[0], "cpu")
    assert EngineConfig(device="cpu", dtype="float32").resolved().dtype == "float32"
    # quantized blocks: a .gguf file, or a checkpoint quantized at load
    blocks = auto_blocks_dtype(this_cpu())[0]
    assert EngineConfig(model="/m/x.gguf", device="cpu").resolved().dtype == blocks
    assert EngineConfig(model="tiny-random", device="cpu", quantization="q8_0").resolved().dtype == blocks


def test_loading_the_kernel_keeps_denormals() -> None:
    """The library must not switch the process to flush-to-zero (what linking -ffast-math code does): torch's
    own arithmetic in the same process would change under it."""
    assert load_kernel() is not None
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1.0).item() > 0.0
