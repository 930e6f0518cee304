"""Neox RoPE (incl. llama3-scaled caches) and Qwen3's fused q/k-norm + RoPE vs Hugging Face's modules."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kernels.rope import apply_rope, apply_rope_ref, cos_sin_cache_from_inv_freq, qk_norm_rope
from tests.kernels.paged_cases import DEVICE, TOL, rel_err

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _hf_rotary(head_dim: int, theta: float, scaling: dict | None, max_pos: int) -> LlamaRotaryEmbedding:
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_theta=theta,
                      rope_scaling=scaling, max_position_embeddings=max_pos)
    return LlamaRotaryEmbedding(cfg)


def _hf_apply(rot, q, k, positions):
    cos, sin = rot(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize("head_dim,theta,scaling,dtype", [
    (64, 500000.0, LLAMA3, torch.float32),   # Llama-3.2: llama3 scaling, checked past 8192
    (128, 1e6, None, torch.float16),         # Qwen
    (128, 1e4, None, torch.bfloat16),
])
def test_rope_matches_transformers(head_dim, theta, scaling, dtype):
    rot = _hf_rotary(head_dim, theta, scaling, 131072)
    positions = torch.tensor([0, 1, 7, 4095, 8191, 9000, 20000, 100000])
    cache = cos_sin_cache_from_inv_freq(rot.inv_freq, 100001)
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(len(positions), 7, head_dim, generator=g).to(DEVICE, dtype)
    q, k = qkv[:, :4], qkv[:, 4:6]  # rotated in place: strided views of a fused projection
    q_hf, k_hf = _hf_apply(rot, q.cpu(), k.cpu(), positions)
    v_before = qkv[:, 6].clone()
    out_q, out_k = apply_rope(q, k, positions.to(DEVICE), cache.to(DEVICE))
    assert out_q.data_ptr() == q.data_ptr()
    assert rel_err(q, q_hf) < TOL[dtype] and rel_err(k, k_hf) < TOL[dtype]
    assert torch.equal(qkv[:, 6], v_before)  # neighbours in the fused buffer untouched


def test_partial_rotary_leaves_tail_untouched():
    cache = cos_sin_cache_from_inv_freq(1.0 / 10000 ** (torch.arange(0, 32, 2) / 32), 64)  # rotary dim 32 of 64
    cache = cache.to(DEVICE)
    q, k = torch.randn(5, 3, 64, device=DEVICE), torch.randn(5, 1, 64, device=DEVICE)
    positions = torch.tensor([0, 3, 9, 33, 63], device=DEVICE)
    q_ref, k_ref = apply_rope_ref(q, k, positions, cache)
    apply_rope(q, k, positions, cache)
    assert rel_err(q, q_ref) < 1e-6 and rel_err(k, k_ref) < 1e-6
    assert torch.equal(q[..., 32:], q_ref[..., 32:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_qk_norm_rope_matches_qwen3_modules(dtype):
    head_dim = 128
    rot = _hf_rotary(head_dim, 1e6, None, 40960)
    positions = torch.tensor([0, 5, 17, 40000])
    cache = cos_sin_cache_from_inv_freq(rot.inv_freq, 40960)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 4, head_dim, generator=g).to(dtype), torch.randn(4, 2, head_dim, generator=g).to(dtype)
    q_norm, k_norm = Qwen3RMSNorm(head_dim, 1e-6), Qwen3RMSNorm(head_dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim, generator=g))
        k_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim, generator=g))
        q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
        q_hf, k_hf = _hf_apply(rot, q_norm(q), k_norm(k), positions)
    q, k = q.to(DEVICE), k.to(DEVICE)
    qk_norm_rope(q, k, positions.to(DEVICE), cache.to(DEVICE), q_norm.weight.detach().to(DEVICE),
                 k_norm.weight.detach().to(DEVICE), 1e-6)
    assert rel_err(q, q_hf) < TOL[dtype] and rel_err(k, k_hf) < TOL[dtype]


def test_rope_rejects_bad_cache():
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope(torch.zeros(2, 2, 64), torch.zeros(2, 1, 64), torch.zeros(2, dtype=torch.long), torch.zeros(8, 66))
