"""CPU attention backend: the compiled paged-attention kernel (kernels/cpu/attention.cpp) where it applies.

The torch reference (torch_ref.py) copies every sequence's K/V through its block table into dense tensors
in every layer; the kernel writes the step's K/V into the cache and walks the block tables itself, in fp32 or
bf16 with fp32 accumulation, in one call per layer. Other dtypes, or a machine without a C++ compiler, fall
back to the reference.
"""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.cpu_kernels import load_cpu_paged_attention


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.kernel = load_cpu_paged_attention()
        self.fallback = TorchAttentionBackend()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.kernel is None or not self.kernel.applies(q):
            return self.fallback.forward(q, k, v, k_cache, v_cache, meta, scale)
        return self.kernel(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                           meta.cu_seqlens_q, scale)
