"""RMSNorm and fused residual-add + RMSNorm: one program per row, fp32 reduction.

Rounding follows the Hugging Face modules the engine must match token for token: the residual sum is rounded
to the model dtype and normalised from that rounded value, and the normalised row is rounded to the model
dtype before the weight multiplies it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_HIDDEN = 65536  # one row per program must fit the registers


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] without a copy when the layout allows; head dim kept contiguous."""
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, residual_out: torch.Tensor | None) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}] to normalise rows of size {hidden}; got {tuple(weight.shape)}.")
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"rms_norm supports hidden sizes up to {_MAX_HIDDEN}; got {hidden}.")
    xr, outr = _rows(x, hidden), out.view(-1, hidden)
    if xr.shape[0] == 0:
        return
    rr = _rows(residual, hidden) if residual is not None else xr
    ror = residual_out.view(-1, hidden) if residual_out is not None else outr
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(xr.shape[0],)](
        xr, rr, weight, outr, ror, xr.stride(0), rr.stride(0), outr.stride(0), ror.stride(0), eps,
        N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 8),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim; returns a new tensor in x's dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual') in one pass over the rows.

    inplace=True writes the normed rows into x and residual' into residual (both must be contiguous).
    """
    if residual.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape.")
    if inplace:
        if not (x.is_contiguous() and residual.is_contiguous()):
            raise ValueError("fused_add_rms_norm(inplace=True) needs contiguous x and residual.")
        out, res_out = x, residual
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, res_out)
    return out, res_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure-torch reference with the same rounding points (Hugging Face LlamaRMSNorm)."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm_ref(summed.to(x.dtype), weight, eps), summed
