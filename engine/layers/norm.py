"""RMSNorm, computed in fp32 like the reference implementation, with an optional fused residual add."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    # kernels.norm when the model runs its Triton kernels (one fused launch instead of ~6 ops)
    fused = None

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self.fused is not None:
            if residual is None:
                return self.fused.rms_norm(x, self.weight, self.eps)
            return self.fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
