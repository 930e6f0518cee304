"""Triton attention backend: KV write, then split-KV decode (decode-only steps) or prefill/extend.

Decode-only steps are what CUDA graphs capture, so that path uses only shapes and preallocated buffers: the
split count comes from the batch size (fixed per graph bucket) and the split-KV workspace is allocated once,
at the size the largest batch needs.
"""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from kernels.kv_cache import store_kv_cache
from kernels.paged_attention import choose_num_splits, decode_workspace, paged_decode_attention, paged_prefill_attention


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill. The CPU interpreter runs programs one by one, so splitting the keys
    there only adds work: one 'SM' keeps it at a single split."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads}).")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {max_num_seqs}.")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_num_seqs = max_num_seqs
        self.device, self.dtype = torch.device(device), dtype
        self.num_sms = _num_sms(self.device)
        # Rows needed by batch b are b * splits(b); take the maximum over every batch size we may see.
        rows = max(b * self.num_splits(b) for b in range(1, max_num_seqs + 1))
        self.workspace = decode_workspace(rows, num_heads, head_dim, self.device)

    def num_splits(self, num_seqs: int) -> int:
        """Split-KV count for a decode batch of num_seqs rows (a shape, never a sequence length)."""
        return choose_num_splits(num_seqs, self.num_kv_heads, self.num_sms)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            num_seqs = meta.block_tables.shape[0]
            if num_seqs > self.max_num_seqs:
                raise ValueError(f"decode batch of {num_seqs} sequences exceeds max_num_seqs={self.max_num_seqs} "
                                 "given to TritonAttentionBackend.")
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          self.num_splits(num_seqs), workspace=self.workspace)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                                       meta.max_seqlen_q, scale)
