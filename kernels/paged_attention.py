"""Paged attention over the KV cache: decode (split-KV, GQA-packed) and prefill/extend (varlen, paged prefix).

Both kernels read every key and value through the block table (cache layout
[num_blocks, block_size, num_kv_heads, head_dim]); new tokens' K/V must be written by store_kv_cache first.
One program owns one KV head and packs the query heads of its GQA group into the rows of the tl.dot M
dimension, so each K/V tile is loaded once per group. The softmax is online, in fp32 and base 2.
Every per-step quantity (seq_lens, cu_seqlens_q, block ids) is read on the device and the grids depend only on
tensor shapes, so the decode path can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q, start, kmax, kv_end, bt_row, k_base, v_base,
                 stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                 MASKED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr):
    """One online-softmax step over keys [start, start + TILE).

    Unmasked tiles lie wholly inside every row's visible range; masked tiles only load keys < kv_end (so
    NaN-poisoned or unallocated slots past the sequence are never read) and let row r see key j iff
    j <= kmax[r]. Rows that saw no key yet keep m = 0 instead of -inf, so exp2 never sees inf - inf.
    """
    pos = start + tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    live = pos < kv_end
    # Block ids are looked up per token, so a tile may span several pages (any power-of-two page size).
    if MASKED:
        phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        k = tl.load(k_base + (phys * stride_kb + (pos % BLOCK_SIZE) * stride_kt)[None, :] + offs_d[:, None],
                    mask=live[None, :], other=0.0)
    else:
        phys = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_base + (phys * stride_kb + (pos % BLOCK_SIZE) * stride_kt)[None, :] + offs_d[:, None])
    if DOT_FP32:  # fp32 caches, or the interpreter (whose bf16 tl.dot multiplies bit patterns)
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=DOT_PREC)
    else:
        s = tl.dot(q, k)
    s = s * qk_scale
    if MASKED:
        s = tl.where((pos[None, :] <= kmax[:, None]) & live[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + (phys * stride_vb + (pos % BLOCK_SIZE) * stride_vt)[:, None] + offs_d[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=live[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision=DOT_PREC)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, ws_ptr,
                   stride_qs, stride_qh, stride_os, stride_oh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_bt, stride_wr, stride_wh, qk_scale,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)
    # This split's tile range; seq_len 0 (a padding row) or a surplus split gives an empty range.
    n_tiles = (seq_len + TILE - 1) // TILE  # plain arithmetic: tl.cdiv is a nested jit call, slow when interpreted
    per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_tiles)
    n_full = seq_len // TILE
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    kmax = tl.zeros([G_PAD], tl.int32) + seq_len - 1
    bt_row = bt_ptr + seq * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    for t in range(lo, tl.minimum(hi, n_full)):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, t * TILE, kmax, seq_len, bt_row, k_base, v_base,
                                     stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, TILE, False, DOT_FP32, DOT_PREC)
    for t in range(tl.maximum(lo, n_full), hi):  # the last, partial tile (at most one)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, t * TILE, kmax, seq_len, bt_row, k_base, v_base,
                                     stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, TILE, True, DOT_FP32, DOT_PREC)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty rows (seq_len 0) give exactly 0
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        ws = ws_ptr + (seq * NUM_SPLITS + split) * stride_wr + heads * stride_wh
        tl.store(ws[:, None] + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(ws + HEAD_DIM, m_i, mask=g_mask)
        tl.store(ws + HEAD_DIM + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(ws_ptr, out_ptr, stride_wr, stride_wh, stride_os, stride_oh,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr):
    """Merges the splits' partial (acc, m, l) of one (sequence, query head)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    rows = ws_ptr + (seq * NUM_SPLITS + offs_s) * stride_wr + head * stride_wh
    m = tl.load(rows + HEAD_DIM, mask=s_mask, other=float("-inf"))
    l = tl.load(rows + HEAD_DIM + 1, mask=s_mask, other=0.0)
    acc = tl.load(rows[:, None] + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: weights 0, output 0
    w = tl.exp2(m - m_max)
    den = tl.sum(w * l, 0)
    num = tl.sum(w[:, None] * acc, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, out_ptr, num_seqs,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, qk_scale,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
                    DOT_FP32: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # Sequence s owns q-blocks [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1): find ours by bisection.
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # surplus program of the static upper-bound grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    # Row r is query token q_block * BLOCK_Q + r // GROUP, query head kvh * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_block * BLOCK_Q + offs_m // GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    heads = kvh * GROUP + offs_m % GROUP
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)
    kmax = ctx_len + tok  # causal: query i sees key j iff j <= context_len + i
    # Keys [0, first_visible) are seen by every row; no row sees a key >= kv_end. The clamp keeps inconsistent
    # metadata (q_len > seq_len, as in memory-profiling runs) from indexing tile -1.
    first_visible = tl.maximum(ctx_len + q_block * BLOCK_Q + 1, 0)
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    n_full = first_visible // TILE
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    for t in range(0, n_full):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, t * TILE, kmax, kv_end, bt_row, k_base, v_base,
                                     stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, TILE, False, DOT_FP32, DOT_PREC)
    for t in range(n_full, (kv_end + TILE - 1) // TILE):  # tiles on the causal diagonal
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, t * TILE, kmax, kv_end, bt_row, k_base, v_base,
                                     stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, TILE, True, DOT_FP32, DOT_PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok64[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


# ----------------------------------------------------------------------------------------------- host side

MAX_SPLITS = 16


def _dot_mode(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(upcast dot operands to fp32?, input precision). fp32 caches need IEEE dots (tf32 would cost ~1e-3)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1" or device.type == "cpu"
    dot_fp32 = interpreting or dtype == torch.float32
    return dot_fp32, ("ieee" if dot_fp32 else "tf32")


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> int:
    """Validates shapes and returns the GQA group size (query heads per KV head)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim]; got shape {tuple(q.shape)}.")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}.")
    head_dim, num_kv_heads = k_cache.shape[3], k_cache.shape[2]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache (num_kv_heads={num_kv_heads}, "
                         f"head_dim={head_dim}): num_heads must be a multiple of num_kv_heads.")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"the Triton attention kernels need a power-of-two head_dim in [16, 256]; got {head_dim}. "
                         "Use attention_backend='torch' for this model.")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the KV caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype.")
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs]; got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}.")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("the KV caches and block_tables must be contiguous in their last dimension.")
    return q.shape[1] // num_kv_heads


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim; "
                         f"got {tuple(out.shape)} {out.dtype}.")
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Static split-KV heuristic: about two programs per SM, a power of two in [1, MAX_SPLITS].

    It depends only on the batch size (fixed per CUDA-graph bucket), never on sequence lengths.
    """
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(math.ceil(2 * num_sms / programs))))


def decode_workspace(num_rows: int, num_heads: int, head_dim: int, device: torch.device | str) -> torch.Tensor:
    """Split-KV scratch: row seq * num_splits + split holds each head's [acc (head_dim) | m | l] in fp32."""
    return torch.empty(num_rows, num_heads, head_dim + 2, dtype=torch.float32, device=device)


def _decode_config(head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(KV tile in tokens, num_warps, num_stages). Interpreter: big tiles, since it pays per op, not per byte."""
    if device.type == "cpu":
        return 32, 4, 1
    return (32 if head_dim <= 128 else 16), 4, 3


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                           out: torch.Tensor | None = None, workspace: torch.Tensor | None = None, *,
                           tile: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim].

    Sequence i attends to its seq_lens[i] cached tokens (0 = padding row, output 0). With num_splits > 1 the
    keys are cut into num_splits ranges reduced by a second kernel through `workspace`
    (decode_workspace(num_seqs * num_splits, ...), or allocated here). No host sync: graph-capturable.
    """
    group = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"decode takes one query per sequence: q has {q.shape[0]} rows for "
                         f"{block_tables.shape[0]} sequences.")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}]; got {num_splits}.")
    out = _output(q, out)
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return out
    if num_splits > 1:
        if workspace is None:
            workspace = decode_workspace(num_seqs * num_splits, num_heads, head_dim, q.device)
        if (workspace.dtype != torch.float32 or workspace.shape[0] < num_seqs * num_splits
                or tuple(workspace.shape[1:]) != (num_heads, head_dim + 2)):
            raise ValueError(f"workspace must be fp32 [>= {num_seqs * num_splits}, {num_heads}, {head_dim + 2}]; "
                             f"got {workspace.dtype} {tuple(workspace.shape)}.")
    ws = workspace if num_splits > 1 else out  # unused by the 1-split kernel
    q = q if q.stride(-1) == 1 else q.contiguous()
    d_tile, d_warps, d_stages = _decode_config(head_dim, q.device)
    dot_fp32, prec = _dot_mode(q.dtype, q.device)
    _decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, ws,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), ws.stride(0), ws.stride(1), scale * _LOG2E,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], TILE=tile or d_tile, NUM_SPLITS=num_splits,
        DOT_FP32=dot_fp32, DOT_PREC=prec, num_warps=num_warps or d_warps, num_stages=num_stages or d_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            workspace, out, workspace.stride(0), workspace.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLIT_PAD=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def _prefill_config(group: int, head_dim: int, max_seqlen_q: int, device: torch.device
                    ) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, KV tile, num_warps, num_stages); BLOCK_M shrinks for short queries (mixed batches)."""
    cap = 64 if device.type == "cpu" else 128
    g_pad = max(16, triton.next_power_of_2(group))
    block_m = max(g_pad, min(cap, triton.next_power_of_2(max(1, max_seqlen_q) * group)))
    if device.type == "cpu":
        return block_m, 32, 4, 1
    tile = 64 if head_dim <= 128 else 32
    warps = 8 if block_m * head_dim >= 128 * 128 else 4
    return block_m, tile, warps, (3 if head_dim <= 128 else 2)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            max_seqlen_q: int, scale: float, out: torch.Tensor | None = None, *,
                            block_m: int | None = None, tile: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> torch.Tensor:
    """Variable-length causal attention over a paged prefix: q [num_tokens, num_heads, head_dim].

    Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1], its last q_len of seq_lens[i] tokens; query
    i sees key j iff j <= seq_len - q_len + i. Covers fresh prompts, chunked prefill, prefix-cache hits and
    decode rows (q_len 1) in one launch. max_seqlen_q (a host int) only picks the tile shape.
    """
    group = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = block_tables.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens_q must be [num_seqs + 1 = {num_seqs + 1}]; got {tuple(cu_seqlens_q.shape)}.")
    out = _output(q, out)
    num_tokens, _, head_dim = q.shape
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    c_m, c_tile, c_warps, c_stages = _prefill_config(group, head_dim, max_seqlen_q, q.device)
    block_m = block_m or c_m
    if block_m < group:
        raise ValueError(f"block_m ({block_m}) must hold at least one token's {group} query heads.")
    block_q = block_m // group
    dot_fp32, prec = _dot_mode(q.dtype, q.device)
    # Static upper bound on the number of q-blocks: sum_i ceil(q_len_i / BLOCK_Q) <= T // BLOCK_Q + num_seqs.
    grid = (num_tokens // block_q + num_seqs, k_cache.shape[2])
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE=tile or c_tile, DOT_FP32=dot_fp32, DOT_PREC=prec,
        num_warps=num_warps or c_warps, num_stages=num_stages or c_stages,
    )
    return out


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 reference of both kernels (decode: cu_seqlens_q = arange(num_seqs + 1)). Slow; for tests."""
    group = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size = k_cache.shape[1]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_len = cu[i + 1] - cu[i]
        if q_len == 0 or seq_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = block_tables[i].cpu().long()[pos // block_size]
        k = k_cache.cpu()[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        v = v_cache.cpu()[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[i]:cu[i + 1]].cpu().double(), k) * scale
        visible = pos[None, :] <= (seq_len - q_len) + torch.arange(q_len)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[cu[i]:cu[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
