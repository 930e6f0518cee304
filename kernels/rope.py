"""Rotary position embedding (neox half-split) from a precomputed cos/sin cache, optionally fused with
Qwen3's per-head q/k RMSNorm. One program per token rotates all of its query and key heads in place.

cos_sin_cache[pos] = [cos(pos * f_0..f_{R/2-1}) | sin(...)], fp32, R = rotary dim <= head_dim. Any frequency
scaling (llama3, linear) is baked into the cache by the caller. Dimensions past R are left untouched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm import rms_norm_ref


@triton.jit
def _rotate_heads(base, stride_h, cos, sin, w_ptr, eps,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  NORM: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs[None, :] < HALF)
    ptr1 = base + offs_h[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # RMSNorm over the head (rotary dim == head_dim here), rounded like the HF module
        dtype = base.dtype.element_ty
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    tl.store(ptr1, (x1 * cos[None, :] - x2 * sin[None, :]).to(base.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr, eps,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_c + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, qw_ptr, eps,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF, NORM)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, kw_ptr, eps,
                  NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF, NORM)


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> int:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be [num_tokens, heads, head_dim] with equal tokens and head_dim; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}.")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [num_tokens={q.shape[0]}]; got {tuple(positions.shape)}.")
    rot = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rot <= 0 or rot % 2 or rot > q.shape[2]:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim] with an even rotary_dim <= head_dim "
                         f"({q.shape[2]}); got {tuple(cos_sin_cache.shape)}.")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache must be contiguous in their last dimension (rotated in place).")
    return rot // 2


def _launch(q, k, positions, cos_sin_cache, q_weight, k_weight, eps: float, norm: bool) -> None:
    half = _check(q, k, positions, cos_sin_cache)
    if q.shape[0] == 0:
        return
    width = max(q.shape[1], k.shape[1]) * half
    _rope_kernel[(q.shape[0],)](
        q, k, positions, cos_sin_cache, q_weight, k_weight, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half,
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), NORM=norm, num_warps=4 if width >= 1024 else 1,
    )


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (they may be views of a fused qkv); returns them."""
    _launch(q, k, positions, cos_sin_cache, cos_sin_cache, cos_sin_cache, 0.0, norm=False)
    return q, k


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: per-head RMSNorm of q and k (weights [head_dim]) then RoPE, fused, in place; returns (q, k)."""
    head_dim = q.shape[-1]
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(f"q/k norm weights must be [head_dim={head_dim}]; got {tuple(q_weight.shape)} and "
                         f"{tuple(k_weight.shape)}.")
    if cos_sin_cache.dim() == 2 and cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("qk_norm_rope needs a full rotary dim (cos_sin_cache width == head_dim).")
    _launch(q, k, positions, cos_sin_cache, q_weight, k_weight, eps, norm=True)
    return q, k


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of apply_rope; returns new tensors."""
    cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    return _rope_ref(q, cos, sin), _rope_ref(k, cos, sin)


def qk_norm_rope_ref(q, k, positions, cos_sin_cache, q_weight, k_weight, eps):
    """Pure-torch reference of qk_norm_rope; returns new tensors."""
    return apply_rope_ref(rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps), positions, cos_sin_cache)


def cos_sin_cache_from_inv_freq(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """[max_position, 2 * len(inv_freq)] fp32 cache in the layout the kernel reads (scaling already in inv_freq)."""
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
