"""CPU attention backend: a compiled paged-attention kernel that reads the KV cache in place.

The torch reference (torch_ref.py) copies every sequence's K/V through its block table into dense tensors
in every layer; this backend's kernel (cpu_kernel.cpp) writes the step's K/V into the cache and walks the
block tables itself, for decode rows, prefill chunks over a cached prefix and mixed batches alike, in fp32 or
bf16 with fp32 accumulation, in one call per layer. Other dtypes, or a machine without a C++ compiler, fall back to the reference.
"""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.cpu_build import load_kernel

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads int32 rows (the model runner's metadata already is; tests may pass int64)."""
    return t.to(torch.int32).contiguous()


def _rows_of_heads(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with contiguous heads; rows may stay strided (views of the fused qkv output)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.lib = load_kernel()
        self.fallback = TorchAttentionBackend()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.lib is None or q.dtype not in KERNEL_DTYPES or q.device.type != "cpu":
            return self.fallback.forward(q, k, v, k_cache, v_cache, meta, scale)
        q, k, v = q.contiguous(), _rows_of_heads(k), _rows_of_heads(v)
        out = torch.empty_like(q)
        slots, block_tables, seq_lens, cu = (_int32(t) for t in (meta.slot_mapping, meta.block_tables,
                                                                  meta.seq_lens, meta.cu_seqlens_q))
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
