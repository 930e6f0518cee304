"""Rotary position embedding (neox style) from a precomputed cos/sin cache, incl. llama3 scaling."""
from __future__ import annotations

import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type not in ("default", None):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3).")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos_sin_cache[pos] = [cos(pos * f) | sin(pos * f)] for the head_dim/2 frequencies f."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        # Every layer of one forward rotates at the same positions: look them up once per forward.
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, positions: torch.Tensor) -> None:
        """Called by the model at the start of each forward (positions may be a buffer refilled in place)."""
        self._cos_sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        self._positions = positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not self._positions:
            self.prepare(positions)
        return self._cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies (computed in fp32)."""
        cos, sin = self.cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """q and k side by side, qk: [T, Hq + Hkv, D] -> one rotated copy (one set of ops for both)."""
        cos, sin = self.cos_sin(positions)
        return _rotate(qk, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
