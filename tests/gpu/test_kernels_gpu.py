"""The kernel correctness cases on a real GPU, in bf16 (< 1e-2 vs float64), plus what only a GPU can show:
CUDA-graph capture/replay of the decode path and the absence of host syncs.  Run: pytest tests/gpu -q
"""
from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.attention.triton import TritonAttentionBackend
from kernels.activation import silu_and_mul
from kernels.kv_cache import store_kv_cache, store_kv_cache_ref
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.paged_attention import (
    decode_workspace,
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)
from kernels.rope import apply_rope, apply_rope_ref, cos_sin_cache_from_inv_freq, qk_norm_rope, qk_norm_rope_ref
from tests.kernels.paged_cases import (
    DECODE_CASES,
    PREFILL_CASES,
    case_id,
    make_case,
    make_decode_case,
    make_engine_batch,
    make_prefill_case,
    prefill_pairs,
    rel_err,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, DEV, TOL = torch.bfloat16, "cuda", 1e-2


def _decode(case, splits: int) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    return paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                  splits, out=out)


def _prefill(case) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    return paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.cu_seqlens_q, case.max_seqlen_q, case.scale, out=out)


def _ref(case) -> torch.Tensor:
    return paged_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.cu_seqlens_q, case.scale)


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, cu: list[int], tol: float) -> None:
    assert not out.isnan().any()
    for i in range(len(cu) - 1):
        if ref[cu[i]:cu[i + 1]].abs().sum() == 0:  # padding row
            assert out[cu[i]:cu[i + 1]].abs().sum() == 0
        else:
            assert rel_err(out[cu[i]:cu[i + 1]], ref[cu[i]:cu[i + 1]]) < tol, f"sequence {i}"


@pytest.mark.parametrize("case", DECODE_CASES, ids=[case_id(c[:3] + (BF16,) + c[4:]) for c in DECODE_CASES])
def test_decode_bf16(case):
    group, head_dim, block_size, _, splits, kv_heads = case
    c = make_decode_case(group, kv_heads, head_dim, block_size, BF16, seed=group + splits, device=DEV)
    assert_rows_close(_decode(c, splits), _ref(c), c.cu_seqlens_q.tolist(), TOL)


@pytest.mark.parametrize("group,head_dim", [(2, 128), (4, 64), (8, 128)])
def test_decode_bf16_serving_shapes_all_split_counts(group, head_dim):
    g = torch.Generator().manual_seed(group)
    lens = torch.randint(1, 2000, (31,), generator=g).tolist() + [0]
    c = make_case(lens, [1] * len(lens), 8 * group, 8, head_dim, 16, BF16, DEV, seed=group)
    ref = _ref(c)
    outs = [_decode(c, s) for s in (1, 2, 16)]
    for out in outs:
        assert_rows_close(out, ref, c.cu_seqlens_q.tolist(), TOL)
    # splits change where P is rounded to bf16, so they agree to bf16 rounding, not bitwise
    assert rel_err(outs[1], outs[0]) < 5e-3 and rel_err(outs[2], outs[0]) < 5e-3


def test_decode_and_prefill_fp32_use_ieee_dots():
    c = make_decode_case(4, 2, 128, 16, torch.float32, seed=0, device=DEV)
    assert_rows_close(_decode(c, 2), _ref(c), c.cu_seqlens_q.tolist(), 1e-5)
    p = make_prefill_case(prefill_pairs(16), 2, 2, 64, 16, torch.float32, seed=0, device=DEV)
    assert_rows_close(_prefill(p), _ref(p), p.cu_seqlens_q.tolist(), 1e-5)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[case_id(c[:3] + (BF16,) + c[4:]) for c in PREFILL_CASES])
def test_prefill_bf16(case):
    group, head_dim, block_size, _, kv_heads = case
    c = make_prefill_case(prefill_pairs(block_size), group, kv_heads, head_dim, block_size, BF16, seed=group,
                          device=DEV)
    assert_rows_close(_prefill(c), _ref(c), c.cu_seqlens_q.tolist(), TOL)


@pytest.mark.parametrize("group,head_dim", [(2, 128), (4, 64)])
def test_prefill_bf16_long_prompts_and_chunks(group, head_dim):
    pairs = [(0, 1024), (700, 300), (3, 1), (0, 129), (2000, 1)]
    c = make_prefill_case(pairs, group, 8, head_dim, 16, BF16, seed=1, device=DEV)
    assert_rows_close(_prefill(c), _ref(c), c.cu_seqlens_q.tolist(), TOL)


def test_kv_store_bf16_round_trip():
    k, v = torch.randn(2, 37, 8, 128, device=DEV, dtype=BF16).unbind(0)
    slots = torch.randperm(64 * 16, device=DEV)[:37]
    slots[::5] = -1
    caches = [torch.full((64, 16, 8, 128), float("nan"), device=DEV, dtype=BF16) for _ in range(4)]
    store_kv_cache(k, v, caches[0], caches[1], slots)
    store_kv_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.int16), caches[2].view(torch.int16))
    assert torch.equal(caches[1].view(torch.int16), caches[3].view(torch.int16))


def test_elementwise_kernels_bf16():
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(2, 33, 2048, generator=g) * 2).to(DEV, BF16).unbind(0)
    w = (1 + 0.1 * torch.randn(2048, generator=g)).to(DEV, BF16)
    xd, rd = x.double(), res.double()
    norm64 = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()  # noqa: E731
    assert rel_err(rms_norm(x, w, 1e-6), norm64(xd)) < TOL
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    assert rel_err(new_res, xd + rd) < TOL and rel_err(out, norm64(new_res.double())) < TOL
    gate, up = xd[:, :1024], xd[:, 1024:]
    assert rel_err(silu_and_mul(x), gate * torch.sigmoid(gate) * up) < TOL
    cache = cos_sin_cache_from_inv_freq(1.0 / 1e6 ** (torch.arange(0, 128, 2) / 128), 4096).to(DEV)
    pos = torch.randint(0, 4096, (33,), generator=g).to(DEV)
    q, k = torch.randn(33, 16, 128, generator=g).to(DEV, BF16), torch.randn(33, 8, 128, generator=g).to(DEV, BF16)
    q_ref, k_ref = apply_rope_ref(q, k, pos, cache)
    apply_rope(q, k, pos, cache)
    assert rel_err(q, q_ref) < TOL and rel_err(k, k_ref) < TOL
    qw, kw = w[:128], w[128:256]
    q_ref, k_ref = qk_norm_rope_ref(q, k, pos, cache, qw, kw, 1e-6)
    qk_norm_rope(q, k, pos, cache, qw, kw, 1e-6)
    assert rel_err(q, q_ref) < TOL and rel_err(k, k_ref) < TOL


def test_backend_matches_torch_backend_bf16():
    batch = make_engine_batch([(0, 300), (40, 60), (64, 16), (5, 1), (900, 1)], 16, 8, 128, 16, seed=3,
                              dtype=BF16, device=DEV)
    kc, vc = batch.k_cache.nan_to_num(0.0), batch.v_cache.nan_to_num(0.0)
    out = TritonAttentionBackend(16, 8, 128, 8, DEV, BF16).forward(*batch.args(128 ** -0.5))
    ref = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, kc, vc, batch.meta, 128 ** -0.5)
    assert torch.equal(batch.k_cache.nan_to_num(0.0), kc)
    assert not out.isnan().any() and rel_err(out, ref) < TOL


def _copy_batch(dst, src) -> None:
    """Rewrites a captured batch's buffers in place (what the engine does before a graph replay)."""
    for a, b in ((dst.q, src.q), (dst.k, src.k), (dst.v, src.v), (dst.k_cache, src.k_cache),
                 (dst.v_cache, src.v_cache), (dst.meta.slot_mapping, src.meta.slot_mapping),
                 (dst.meta.seq_lens, src.meta.seq_lens), (dst.meta.block_tables, src.meta.block_tables)):
        a.copy_(b)


def test_decode_step_replays_in_a_cuda_graph_without_host_syncs():
    """Capture store_kv_cache + split-KV decode at bucket 8, replay with other lengths, blocks and padding:
    bitwise equal to eager. Each batch has the same shapes (6 real rows, 2 padding rows)."""
    backend = TritonAttentionBackend(16, 8, 128, max_num_seqs=8, device=DEV, dtype=BF16)
    assert backend.num_splits(8) > 1
    make = lambda seed, ctx: make_engine_batch(  # noqa: E731
        [(c, 1) for c in ctx], 16, 8, 128, 16, seed=seed, pad_rows=2, dtype=BF16, device=DEV,
        num_blocks=64, width=16)
    static = make(0, [0, 15, 16, 17, 100, 200])
    other = make(1, [3, 31, 64, 7, 150, 1])
    backend.forward(*static.args(0.1))  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(*static.args(0.1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(*static.args(0.1))
    _copy_batch(static, other)
    graph.replay()
    replayed = graph_out.clone()
    _copy_batch(static, other)  # same cache state again for the eager run
    eager = backend.forward(*static.args(0.1))
    assert torch.equal(replayed, eager)
    assert torch.equal(replayed[-2:], torch.zeros_like(replayed[-2:]))


def test_workspace_reuse_across_layers_is_exact():
    c = make_decode_case(2, 8, 128, 16, BF16, seed=4, device=DEV)
    ws = decode_workspace(c.q.shape[0] * 16, c.q.shape[1], 128, DEV).fill_(float("nan"))
    first = paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.scale, 16, workspace=ws)
    again = paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.scale, 16, workspace=ws)
    assert torch.equal(first, again)
