"""Prefill/extend kernel (varlen queries over a paged prefix) vs a float64 reference (CPU interpreter)."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref, paged_decode_attention, paged_prefill_attention
from tests.kernels.paged_cases import (
    F32,
    PREFILL_CASES,
    TOL,
    case_id,
    make_case,
    make_prefill_case,
    prefill_pairs,
    rel_err,
)


def _run(case, **kw) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    return paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.cu_seqlens_q, case.max_seqlen_q, case.scale, out=out, **kw)


def _ref(case) -> torch.Tensor:
    return paged_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.cu_seqlens_q, case.scale)


@pytest.mark.parametrize("group,head_dim,block_size,dtype,num_kv_heads", PREFILL_CASES,
                         ids=[case_id(c) for c in PREFILL_CASES])
def test_prefill_matches_reference(group, head_dim, block_size, dtype, num_kv_heads):
    case = make_prefill_case(prefill_pairs(block_size), group, num_kv_heads, head_dim, block_size, dtype,
                             seed=group + head_dim)
    out = _run(case)
    ref = _ref(case)
    assert not out.isnan().any()
    cu = case.cu_seqlens_q.tolist()
    for i in range(len(cu) - 1):  # per sequence, so a short one cannot hide behind the 64-token chunk
        assert rel_err(out[cu[i]:cu[i + 1]], ref[cu[i]:cu[i + 1]]) < TOL[dtype], f"sequence {i}"


def test_many_query_blocks_per_sequence():
    """A small BLOCK_M (8 tokens x group 2) puts one sequence over 8 q-blocks: the bisection over cu_seqlens_q
    and the surplus programs of the upper-bound grid must line up."""
    case = make_prefill_case([(0, 64), (3, 9), (0, 1), (20, 33)], 2, 1, 64, 16, F32, seed=5)
    out = _run(case, block_m=16)
    assert not out.isnan().any()
    assert rel_err(out, _ref(case)) < TOL[F32]


def test_chunked_prefill_equals_one_shot():
    """Prefilling 40 tokens at once equals a 25-token chunk followed by a 15-token chunk over the cached 25."""
    one = make_prefill_case([(0, 40)], 4, 1, 64, 16, F32, seed=11)
    second = make_case([40], [15], 4, 1, 64, 16, F32, seed=11)
    second.k_cache, second.v_cache, second.block_tables = one.k_cache, one.v_cache, one.block_tables
    second.q = one.q[25:].clone()
    torch.testing.assert_close(_run(second), _run(one)[25:], rtol=1e-6, atol=1e-6)


def test_decode_kernel_equals_prefill_kernel_on_single_token_rows():
    case = make_prefill_case([(0, 1), (15, 1), (16, 1), (40, 1)], 4, 2, 64, 16, F32, seed=3)
    prefill = _run(case)
    decode = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                    case.scale, 2)
    torch.testing.assert_close(decode, prefill, rtol=1e-6, atol=1e-6)


def test_prefill_rejects_bad_cu_seqlens():
    case = make_prefill_case([(0, 3), (2, 2)], 2, 1, 64, 16, F32, seed=1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                case.cu_seqlens_q[:-1], 3, case.scale)
