"""The engine's one door to the native CPU kernels (kernels/cpu): which of them a CPU model uses.

Each loader returns None where the kernel cannot run (no C++ compiler, a dtype it lacks, a CPU without the
instructions); the caller then keeps torch's code, which stays the reference.
"""
from __future__ import annotations

import torch

from kernels.cpu.attention import CpuPagedAttention, load_cpu_paged_attention
from kernels.cpu.linear import SmallBatchLinear, load_small_batch_linear
from kernels.cpu.ops import CpuOps, load_cpu_ops
from kernels.cpu.quant import FORMATS as QUANT_FORMATS
from kernels.cpu.quant import QuantKernel, load_quant_kernel

__all__ = ["QUANT_FORMATS", "CpuOps", "CpuPagedAttention", "QuantKernel", "SmallBatchLinear", "load_cpu_ops",
           "load_cpu_paged_attention", "load_quant_kernel", "load_small_batch_linear", "use_cpu_kernels"]


def use_cpu_kernels(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Hand the fused norm/RoPE ops and the small-batch linear to a model that takes them."""
    ops = load_cpu_ops(dtype)
    if ops is not None and hasattr(model, "use_cpu_kernels"):
        model.use_cpu_kernels(ops, load_small_batch_linear(dtype))
