"""The attention layer: owns its slice of the paged KV cache and calls the configured backend."""
from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound by the model runner once the cache is allocated.
        self.backend: AttentionBackend | None = None
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)


def make_backend(name: str, **kwargs) -> AttentionBackend:
    """Imports the Triton backend lazily: CPU installs need not have triton."""
    if name == "torch":
        from engine.attention.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "cpu":
        from engine.attention.cpu import CpuAttentionBackend
        return CpuAttentionBackend()
    if name == "triton":
        from engine.attention.triton import TritonAttentionBackend
        return TritonAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r} (choose cpu, torch or triton).")
