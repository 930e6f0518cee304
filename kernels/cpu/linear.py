"""Linear layers of small batches on CPU through the compiled kernel (linear.cpp), in fp32 or bf16.

With one or a few rows (decode of one or a few sequences) a linear layer is a weight read; the kernel reads
each weight once with AVX-512 FMAs (fp32) or AVX512_BF16 dot products (bf16). Larger batches are
compute-bound and stay with torch's matmuls.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels.cpu.build import load_kernel

# Up to this many rows the kernel was measured faster than torch's matmul (docs/benchmarks.md).
MAX_ROWS = 16
K_STEP = {torch.float32: 16, torch.bfloat16: 32}  # input features per AVX-512 step


class SmallBatchLinear:
    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.lib, self.dtype = lib, dtype
        self.k_step, self.is_bf16 = K_STEP[dtype], int(dtype == torch.bfloat16)

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == self.dtype and weight.dtype == self.dtype
                and x.device.type == "cpu" and weight.is_contiguous() and weight.shape[1] % self.k_step == 0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        if bias is not None:
            bias = bias.to(self.dtype).contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=self.dtype)
        status = self.lib.linear_small_m(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                         out.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1], self.is_bf16)
        return out if status == 0 else F.linear(x, weight, bias)


def load_small_batch_linear(dtype: torch.dtype) -> SmallBatchLinear | None:
    """The kernel for dtype where this CPU has the instructions (AVX-512; AVX512_BF16 for bf16) and a C++
    compiler was found, else None."""
    lib = load_kernel() if dtype in K_STEP else None
    if lib is None:
        return None
    probe = torch.ones(1, K_STEP[dtype], dtype=dtype)
    out = torch.empty(1, 1, dtype=dtype)
    status = lib.linear_small_m(probe.data_ptr(), probe.data_ptr(), None, out.data_ptr(), 1, 1, K_STEP[dtype],
                                int(dtype == torch.bfloat16))
    return SmallBatchLinear(lib, dtype) if status == 0 else None
