"""Builders for paged-attention test cases: a NaN-poisoned paged cache with random, non-contiguous block ids.

Every cache slot that no sequence owns (the null block 0, unused blocks, the tail of each last block) and two
guard blocks just outside the cache tensor hold NaN, so any unmasked or out-of-range read surfaces as NaN in
the output. The interpreter cannot detect out-of-bounds loads; this makes them visible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata

# Interpreted on CPU (conftest sets TRITON_INTERPRET=1 there); compiled when a GPU is present.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedCase:
    q: torch.Tensor              # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim] (view into a guarded buffer)
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # [num_seqs, width] int32, padded with the null block 0
    seq_lens: torch.Tensor       # [num_seqs] int32
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1] int32
    max_seqlen_q: int
    scale: float


def _guarded_nan_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: str) -> torch.Tensor:
    buf = torch.full((num_blocks + 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    return buf[1:-1]


def make_case(seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype = torch.float32, device: str = DEVICE, seed: int = 0,
              spare_blocks: int = 3) -> PagedCase:
    """Sequence i has seq_lens[i] cached tokens, the last q_lens[i] of which are queries (0/0 = padding row)."""
    assert all(q <= s or s == 0 for s, q in zip(seq_lens, q_lens))
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is the null block
    width = max(blocks_per_seq + [1]) + 2
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    k_cache = _guarded_nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    v_cache = _guarded_nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        mine, ids = ids[:n], ids[n:]
        block_tables[i, :n] = torch.tensor(mine, dtype=torch.int32)
        for pos in range(0, seq_len, block_size):
            rows = min(block_size, seq_len - pos)
            blk = mine[pos // block_size]
            k_cache[blk, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=g).to(device, dtype)
            v_cache[blk, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=g).to(device, dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g).to(dtype)
    return PagedCase(q.to(device), k_cache, v_cache, block_tables.to(device),
                     torch.tensor(seq_lens, dtype=torch.int32, device=device), cu.to(device),
                     max(q_lens + [1]), head_dim ** -0.5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (ref nonzero)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

F32, F16 = torch.float32, torch.float16

# Samples of group x head_dim x block_size x dtype (x splits): every value of every axis appears, and most
# pairs; the interpreter pays ~15 ms per program, so KV heads stay at 1-2. The GPU tests rerun them in bf16.
DECODE_CASES = [  # (group, head_dim, block_size, dtype, num_splits, num_kv_heads)
    (1, 64, 16, F32, 1, 2),
    (2, 128, 32, F16, 1, 2),
    (4, 64, 32, F32, 2, 2),
    (8, 128, 16, F16, 2, 1),
    (2, 64, 16, F16, 16, 1),
    (8, 64, 32, F32, 16, 1),
    (4, 128, 16, F32, 1, 1),
    (1, 128, 32, F16, 16, 1),
]
PREFILL_CASES = [  # (group, head_dim, block_size, dtype, num_kv_heads)
    (1, 64, 16, F32, 2),
    (2, 128, 32, F16, 1),
    (4, 64, 32, F16, 2),
    (8, 128, 16, F32, 1),
    (2, 64, 16, F32, 1),
    (8, 64, 32, F16, 1),
]


def case_id(case: tuple) -> str:
    names = ["g", "d", "bs", "", "split", "kv"] if len(case) == 6 else ["g", "d", "bs", "", "kv"]
    return "-".join(f"{n}{str(v)[6:] if isinstance(v, torch.dtype) else v}" for n, v in zip(names, case))


def decode_lens(block_size: int) -> list[int]:
    """seq_len 1, page-1, page, page+1, several pages, and a padding row (seq_len 0) last."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 0]


def prefill_pairs(block_size: int) -> list[tuple[int, int]]:
    """(context_len, q_len): fresh prompts of 1 / page-1 / page+1 tokens, prefixes of 1, page-1 and 3 pages
    (prefix-cache hits, later chunks), a 64-token chunk, and decode rows (q_len 1) in the same batch."""
    return [(0, 1), (0, block_size - 1), (0, block_size + 1), (1, 17), (block_size - 1, 2),
            (3 * block_size, 64), (5, 1), (2 * block_size, 1)]


def make_decode_case(group: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                     seed: int, device: str = DEVICE) -> PagedCase:
    lens = decode_lens(block_size)
    return make_case(lens, [1] * len(lens), group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype,
                     device=device, seed=seed)


def make_prefill_case(pairs: list[tuple[int, int]], group: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype: torch.dtype, seed: int, device: str = DEVICE) -> PagedCase:
    return make_case([c + q for c, q in pairs], [q for _, q in pairs], group * num_kv_heads, num_kv_heads,
                     head_dim, block_size, dtype, device=device, seed=seed)


@dataclass
class EngineBatch:
    """What an attention backend receives for one step (new K/V not yet in the cache)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata

    def args(self, scale: float) -> tuple:
        return self.q, self.k, self.v, self.k_cache, self.v_cache, self.meta, scale


def make_engine_batch(pairs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, seed: int, pad_rows: int = 0, dtype: torch.dtype = torch.float32,
                      device: str = DEVICE, num_blocks: int | None = None, width: int | None = None) -> EngineBatch:
    """(context_len, q_len) per sequence: the context is already cached (other slots NaN), the q_len new tokens
    come as k/v for the backend to write. pad_rows appends CUDA-graph padding rows (slot -1, seq_len 0,
    null-block table row, one query token each). num_blocks / width fix the cache and block-table shapes
    (for batches that must fit buffers captured in a CUDA graph)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-(c + q) // block_size) for c, q in pairs]
    num_blocks = num_blocks or 1 + sum(blocks) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(pairs) + pad_rows, width or max(blocks) + 1, dtype=torch.int32)
    k_cache = torch.full((num_blocks * block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = []
    for i, ((ctx, q_len), n) in enumerate(zip(pairs, blocks)):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        pos = torch.arange(ctx + q_len)
        seq_slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        k_cache[seq_slots[:ctx]] = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        v_cache[seq_slots[:ctx]] = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        slots.append(seq_slots[ctx:])
    q_lens = [q for _, q in pairs] + [1] * pad_rows
    slots.append(torch.full((pad_rows,), -1, dtype=torch.long))
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    seq_lens = [c + q for c, q in pairs] + [0] * pad_rows
    meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(device), block_tables=tables.to(device),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                             cu_seqlens_q=cu.to(device), max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
                             is_decode_only=all(q == 1 for q in q_lens))
    q, k, v = (torch.randn(sum(q_lens), h, head_dim, generator=g).to(device, dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return EngineBatch(q, k, v, k_cache.view(shape).to(device), v_cache.view(shape).to(device), meta)
