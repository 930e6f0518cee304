"""The attention backend interface: what every backend receives for one batch.

A batch is a flat list of tokens from several sequences ("varlen"): sequence i owns query tokens
cu_seqlens_q[i]:cu_seqlens_q[i+1]. Those are its *last* q_len tokens; the tokens before them
(context_len = seq_len - q_len) are already in the paged KV cache. Decode rows have q_len 1,
prefill chunks any q_len, and one batch may mix both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [num_tokens] int64; cache slot of each new token, < 0 = do not write
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32; padded with 0 (the null block)
    seq_lens: torch.Tensor       # [num_seqs] int32; context + new tokens, 0 for padding rows
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1] int32; prefix sums of the new tokens per sequence
    max_seqlen_q: int            # host-side maxima, so no backend needs a device->host sync
    max_seqlen_k: int
    is_decode_only: bool         # every row has q_len == 1 (then cu_seqlens_q == arange)


class AttentionBackend:
    """Writes the new K/V into the paged cache, then attends each query over its sequence."""

    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim] in q's dtype."""
        raise NotImplementedError
