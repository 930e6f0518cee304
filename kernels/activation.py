"""SiLU-and-mul for the fused gate_up projection: x [..., 2*I] -> silu(x[..., :I]) * x[..., I:]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(gate) is rounded to the model dtype before the product, as F.silu(gate) * up does in eager torch.
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Returns silu(x[..., :I]) * x[..., I:] as a new [..., I] tensor in x's dtype."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension [..., 2*I]; got shape {tuple(x.shape)}.")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, 2 * inter)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    out_rows = out.view(-1, inter)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out_rows, rows.stride(0), out_rows.stride(0), inter, BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference (the engine's eager formula)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
