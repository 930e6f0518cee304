"""Split-KV decode kernel vs a float64 reference, on NaN-poisoned paged caches (CPU interpreter, tiny shapes)."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import decode_workspace, paged_attention_ref, paged_decode_attention
from tests.kernels.paged_cases import DECODE_CASES, DEVICE, F32, TOL, case_id, make_case, make_decode_case, rel_err


def _run(case, num_splits: int, workspace=None) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))  # every valid element must be written
    return paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.scale, num_splits, out=out, workspace=workspace)


@pytest.mark.parametrize("group,head_dim,block_size,dtype,num_splits,num_kv_heads", DECODE_CASES,
                         ids=[case_id(c) for c in DECODE_CASES])
def test_decode_matches_reference(group, head_dim, block_size, dtype, num_splits, num_kv_heads):
    case = make_decode_case(group, num_kv_heads, head_dim, block_size, dtype, seed=group * head_dim + num_splits)
    k_before = case.k_cache.clone()
    out = _run(case, num_splits)
    cu = torch.arange(case.q.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, cu, case.scale)
    assert not out.isnan().any()
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # padding row: exactly 0
    assert rel_err(out[:-1], ref[:-1]) < TOL[dtype]
    for row in range(out.shape[0] - 1):  # each sequence on its own, so a short one cannot hide in the norm
        assert rel_err(out[row], ref[row]) < TOL[dtype]
    assert torch.equal(case.k_cache.isnan(), k_before.isnan())  # attention never writes the cache


def test_split_counts_agree_and_workspace_is_reusable():
    case = make_case([1, 17, 50, 0, 100], [1] * 5, 2, 1, 64, 16, F32, seed=7)
    base = _run(case, 1)
    # a preallocated, oversized, NaN-filled workspace: the reduce must only read rows this launch wrote
    ws = decode_workspace(5 * 16 * 2, 2, 64, DEVICE).fill_(float("nan"))
    for splits in (2, 16):
        out = _run(case, splits, workspace=ws)
        assert not out.isnan().any()
        torch.testing.assert_close(out, base, rtol=1e-6, atol=1e-6)
    assert torch.equal(_run(case, 16)[3], torch.zeros(2, 64, device=DEVICE))  # all 16 splits empty -> exactly 0


def test_decode_rejects_bad_arguments():
    case = make_case([5, 9], [1, 1], 4, 2, 64, 16, F32)
    with pytest.raises(ValueError, match="num_splits"):
        _run(case, 0)
    with pytest.raises(ValueError, match="workspace"):
        _run(case, 4, workspace=decode_workspace(3, 4, 64, DEVICE))
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_decode_attention(case.q[:1], case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.scale, 1)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(case.q.half(), case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.scale, 1)
    with pytest.raises(ValueError, match="head_dim"):
        bad = torch.zeros(4, 16, 2, 48)
        paged_decode_attention(torch.zeros(2, 4, 48), bad, bad, case.block_tables, case.seq_lens, 1.0, 1)
