"""Paged attention on CPU through the compiled kernel (attention.cpp), in fp32 or bf16.

The kernel writes the step's K/V into the paged cache and walks the block tables itself, for decode rows,
prefill chunks over a cached prefix and mixed batches alike, accumulating in fp32, in one call per layer.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu.build import load_kernel

DTYPES = (torch.float32, torch.bfloat16)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads int32 rows (the model runner's metadata already is; tests may pass int64)."""
    return t.to(torch.int32).contiguous()


def _rows_of_heads(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with contiguous heads; rows may stay strided (views of the fused qkv output)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


class CpuPagedAttention:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def applies(self, q: torch.Tensor) -> bool:
        return q.dtype in DTYPES and q.device.type == "cpu"

    def __call__(self, q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                 scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]; caches [blocks, block_size, Hkv, D]; returns [T, Hq, D]."""
        q, k, v = q.contiguous(), _rows_of_heads(k), _rows_of_heads(v)
        out = torch.empty_like(q)
        slots, block_tables, seq_lens, cu = (_int32(t) for t in (slot_mapping, block_tables, seq_lens,
                                                                  cu_seqlens_q))
        num_heads, head_dim = q.shape[1], q.shape[2]
        status = self.lib.paged_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            slots.data_ptr(), k.shape[0], k.stride(0), v.stride(0), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), cu.data_ptr(), seq_lens.shape[0],
            num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, int(q.dtype == torch.bfloat16))
        if status != 0:
            raise ValueError(f"the CPU attention kernel does not support {num_heads} heads over {k_cache.shape[2]} "
                             f"KV heads of size {head_dim}; use --attention-backend torch.")
        return out


def load_cpu_paged_attention() -> CpuPagedAttention | None:
    """The kernel, or None where no C++ compiler was found."""
    lib = load_kernel()
    return None if lib is None else CpuPagedAttention(lib)
