"""RMSNorm and fused residual-add + RMSNorm vs float64 and vs the Hugging Face formula."""
from __future__ import annotations

import pytest
import torch

from kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tests.kernels.paged_cases import DEVICE, TOL, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close_to_ref(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same rounding points as the eager reference. bf16 only against float64: the interpreter casts
    fp32 -> bf16 by truncation, not round-to-nearest as the GPU does."""
    if out.dtype != torch.bfloat16:
        torch.testing.assert_close(out, ref)


def _f64_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96), (4, 1100)])  # non-power-of-two and multi-dim rows
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(DEVICE, dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, _f64_norm(x, w, 1e-6)) < TOL[dtype]
    _close_to_ref(out, rms_norm_ref(x, w, 1e-6))


def test_rms_norm_strided_rows():
    x = torch.randn(6, 2 * 64, device=DEVICE)[:, :64]  # every other half-row: a non-contiguous view
    w = torch.randn(64, device=DEVICE)
    assert rel_err(rms_norm(x, w, 1e-5), _f64_norm(x, w, 1e-5)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_add_rms_norm(dtype, inplace):
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(7, 80, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = torch.randn(80, generator=g).to(DEVICE, dtype)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6, inplace=inplace)
    ref_out, ref_res = fused_add_rms_norm_ref(x0, res0, w, 1e-6)
    _close_to_ref(new_res, ref_res)  # one rounding of x + residual, like the eager add
    assert rel_err(new_res, x0.double() + res0.double()) < TOL[dtype]
    assert rel_err(out, _f64_norm(ref_res, w, 1e-6)) < TOL[dtype]
    _close_to_ref(out, ref_out)
    if inplace:
        assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    else:
        assert torch.equal(x, x0) and torch.equal(res, res0)


def test_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="same shape"):
        fused_add_rms_norm(torch.zeros(2, 64), torch.zeros(3, 64), torch.ones(64), 1e-6)
