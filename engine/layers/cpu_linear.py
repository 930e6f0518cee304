"""bf16 linear layers of small batches on CPU through the compiled kernel (cpu_linear.cpp).

With one or a few rows (decode of one or a few sequences) a linear layer is a weight read; the kernel reads
each weight once with AVX512_BF16 dot products. Larger batches are compute-bound and stay with torch.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from engine.cpu_build import load_kernel

# Up to this many rows the kernel was measured faster than torch's bf16 and fp32 matmuls (docs/benchmarks.md).
MAX_ROWS = 16
K_MULTIPLE = 32  # input features per AVX512_BF16 step


class SmallBatchLinear:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @staticmethod
    def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
                and weight.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.is_contiguous()
                and weight.shape[1] % K_MULTIPLE == 0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
        status = self.lib.linear_bf16_small_m(x.data_ptr(), weight.data_ptr(),
                                              None if bias is None else bias.data_ptr(), out.data_ptr(),
                                              x.shape[0], weight.shape[0], weight.shape[1])
        return out if status == 0 else F.linear(x, weight, bias)


def load_small_batch_linear() -> SmallBatchLinear | None:
    """The kernel where this CPU has AVX512_BF16 (and a C++ compiler was found), else None."""
    lib = load_kernel()
    if lib is None:
        return None
    probe = torch.ones(1, K_MULTIPLE, dtype=torch.bfloat16)
    out = torch.empty(1, 1, dtype=torch.bfloat16)
    if lib.linear_bf16_small_m(probe.data_ptr(), probe.data_ptr(), None, out.data_ptr(), 1, 1, K_MULTIPLE) != 0:
        return None
    return SmallBatchLinear(lib)
