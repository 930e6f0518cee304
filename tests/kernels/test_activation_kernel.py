"""silu_and_mul vs float64 and the eager formula."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from tests.kernels.paged_cases import DEVICE, TOL, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(3, 2 * 100), (2, 3, 2 * 64), (2, 2 * 1100)])  # 1100: two column blocks
def test_silu_and_mul(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 4).to(DEVICE, dtype)
    out = silu_and_mul(x)
    inter = shape[-1] // 2
    assert out.shape == (*shape[:-1], inter) and out.dtype == dtype
    gate, up = x.double()[..., :inter], x.double()[..., inter:]
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < TOL[dtype]
    torch.testing.assert_close(out, silu_and_mul_ref(x))


def test_silu_and_mul_strided_input():
    x = torch.randn(4, 3 * 64, device=DEVICE)[:, :128]
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < 1e-6


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 5))
