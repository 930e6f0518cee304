"""Pure-PyTorch paged attention: the CPU backend and the reference for the Triton kernels.

Each sequence's keys are gathered through its block table, so prefill chunks, prefix-cache hits and
decodes all take the same path: query i of a sequence with context_len cached tokens sees keys
0..context_len + i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into the paged caches; slots < 0 (padding) are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()  # int64 indices take index_put's fast path
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                        scale: float) -> torch.Tensor:
    """q: [num_tokens, Hq, D], sequences laid out back to back by query_lens."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        if q_len == 0:
            continue
        end = start + q_len
        if seq_len == 0:  # padding row
            out[start:end] = 0
            start = end
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len).repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[i], seq_len).repeat_interleave(group, dim=1)
        context_len = seq_len - q_len
        # key j is visible to query i iff j <= context_len + i
        mask = (torch.arange(seq_len, device=q.device)[None, :]
                <= context_len + torch.arange(q_len, device=q.device)[:, None])
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale).transpose(0, 1)
        start = end
    return out


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, all sequences in one masked SDPA: q [B, Hq, D] -> [B, Hq, D]."""
    blocks = block_tables.long()
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)   # [B, Hkv, width * block_size, D]
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :], scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    # padding rows (seq_len 0) see no key at all: their softmax is NaN; define them as 0
    return torch.where((seq_lens > 0)[:, None, None], out[:, :, 0, :], 0.0)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return paged_decode_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        # One host read of the small per-sequence arrays; on CPU it is free, and this backend is the CPU path.
        seq_lens = meta.seq_lens.tolist()
        cu = meta.cu_seqlens_q.tolist()
        query_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, seq_lens, query_lens, scale)
