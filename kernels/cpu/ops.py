"""The small per-layer ops of a CPU forward (RMSNorm, residual add, RoPE) as compiled kernels (ops.cpp).

The functions have the signatures of the Triton ones in kernels/ (norm.rms_norm, norm.fused_add_rms_norm,
activation.silu_and_mul, rope.apply_rope, rope.qk_norm_rope), so the model plugs them into the same hooks
(RMSNorm.fused, SiluAndMul.fused, Attention.fused_rope); the torch code in engine/layers/norm.py and engine/layers/rotary.py stays the reference.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu.build import load_kernel

DTYPES = (torch.float32, torch.bfloat16)


class CpuOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    # ---- RMSNorm
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.lib.cpu_rms_norm(rows.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, rows.shape[0],
                              rows.shape[1], rows.stride(0), eps, _is_bf16(x))
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual' = x + residual; returns (rms_norm(residual'), residual')."""
        rows, res = _rows(x), residual.contiguous()
        out, res_out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
        self.lib.cpu_rms_norm(rows.data_ptr(), res.data_ptr(), weight.data_ptr(), out.data_ptr(),
                              res_out.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), eps, _is_bf16(x))
        return out, res_out

    # ---- SiLU-and-multiply of the fused gate_up output
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        inter = rows.shape[1] // 2
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
        self.lib.cpu_silu_and_mul(rows.data_ptr(), out.data_ptr(), rows.shape[0], inter, rows.stride(0), _is_bf16(x))
        return out

    # ---- RoPE, in place on q [T, Hq, D] and k [T, Hkv, D] (views of the fused qkv output)
    def apply_rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        self._rope(q, k, positions, cos_sin_cache, None, None, 0.0)
        return q, k

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3: per-head RMSNorm of q and k, then RoPE, in place."""
        self._rope(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)
        return q, k

    def _rope(self, q, k, positions, cos_sin_cache, q_weight, k_weight, eps: float) -> None:
        head_dim = q.shape[2]
        if cos_sin_cache.shape[-1] != head_dim:
            raise ValueError(f"the CPU RoPE kernel rotates whole heads (rotary dim {cos_sin_cache.shape[-1]} != "
                             f"head_dim {head_dim}); use --attention-backend torch.")
        for t in (q, k):
            if t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError("q and k must have contiguous heads to be rotated in place.")
        positions = positions.to(torch.int32).contiguous()  # the model runner's are int32 already
        status = self.lib.cpu_rope(
            q.data_ptr(), k.data_ptr(), positions.data_ptr(), cos_sin_cache.data_ptr(), q.shape[0], q.shape[1],
            k.shape[1], head_dim, q.stride(0), k.stride(0), cos_sin_cache.stride(0),
            None if q_weight is None else q_weight.data_ptr(), None if k_weight is None else k_weight.data_ptr(),
            eps, _is_bf16(q))
        if status != 0:
            raise ValueError(f"the CPU RoPE kernel does not support head_dim {head_dim}.")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, hidden] with unit stride in the last dim (a strided row view is fine, no copy)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def load_cpu_ops(dtype: torch.dtype) -> CpuOps | None:
    """The fused ops for a model in dtype, or None (another dtype, or no C++ compiler here)."""
    lib = load_kernel() if dtype in DTYPES else None
    return None if lib is None else CpuOps(lib)
