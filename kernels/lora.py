"""Batched LoRA for a step whose tokens read different adapters (punica's BGMV): each token reads the slot its
sequence's adapter holds in the projection's tables, one launch for all tokens and slots.

    shrink:  h[t]    = x[t] @ A[slot[t]].T          A [num_slots, W, K] -> h [T, W] (fp32; 0 where slot < 0)
    expand:  out[t] += h[t] @ B[slot[t]]            B [num_slots, W, N]  (nothing where slot < 0)

W is S * max_lora_rank (small); no host sync, so a graph can capture both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, h_ptr, K, W, stride_x, stride_as, stride_aw, stride_h,
                   BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_W,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + w[:, None] * stride_aw + k[None, :],
                    mask=(w[:, None] < W) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_h + w, acc, mask=w < W)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slot_ptr, out_ptr, N, W, stride_h, stride_bs, stride_bw, stride_o,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    h = tl.load(h_ptr + t * stride_h + w, mask=w < W, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + n[:, None] + w[None, :] * stride_bw,
                mask=(n[:, None] < N) & (w[None, :] < W), other=0.0).to(tl.float32)
    prev = tl.load(out_ptr + t * stride_o + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + n, (prev + tl.sum(b * h[None, :], axis=1)).to(out_ptr.dtype.element_ty),
             mask=n < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [num_slots, W, K] (contiguous rows), token_slots [T] -> h [T, W] fp32."""
    num_tokens, k = x.shape
    width = a.shape[1]
    h = torch.zeros(num_tokens, width, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_w = min(64, triton.next_power_of_2(width))
    _shrink_kernel[(num_tokens, triton.cdiv(width, block_w))](
        x, a, token_slots, h, k, width, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_W=block_w, BLOCK_K=min(128, triton.next_power_of_2(k)))
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, N] += h [T, W] @ b[slot] per token (b [num_slots, W, N], rows contiguous), in place."""
    num_tokens, n = out.shape
    if num_tokens == 0:
        return
    if out.stride(-1) != 1:
        raise ValueError("lora_expand writes out in place: its last dimension must be contiguous.")
    width = b.shape[1]
    block_n = min(128, triton.next_power_of_2(n))
    _expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
        h, b, token_slots, out, n, width, h.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_W=triton.next_power_of_2(width))


def lora_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference: out + per-token (x @ A[slot].T) @ B[slot] (tokens with slot < 0 unchanged)."""
    result = out.float().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            result[t] += (x[t].float() @ a[slot].float().T) @ b[slot].float()
    return result.to(out.dtype)
