"""KV write kernel: exact round trip, padding slots skipped, nothing else in the cache touched."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import store_kv_cache, store_kv_cache_ref
from tests.kernels.paged_cases import DEVICE


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so NaN == NaN compares equal and -0.0 != 0.0."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size,dtype", [
    (2, 64, 16, torch.float32), (3, 128, 32, torch.float16), (1, 128, 16, torch.bfloat16), (8, 64, 4, torch.float32),
])
def test_store_matches_reference_and_skips_padding(num_kv_heads, head_dim, block_size, dtype):
    g = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_blocks, num_tokens = 6, 11
    # k and v as strided views of one fused projection output, like the model produces them
    kv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    slots[[1, 4, 9]] = -1  # padding tokens
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    store_kv_cache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(_bits(k_cache), _bits(k_ref)) and torch.equal(_bits(v_cache), _bits(v_ref))
    # round trip: gathering the written slots gives the inputs back, bit for bit
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(k_cache[s // block_size, s % block_size], k[keep])
    assert torch.equal(v_cache[s // block_size, s % block_size], v[keep])
    # exactly the valid slots changed: the rest is still NaN
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[s.cpu()] = True
    assert torch.equal(~k_cache.view(-1, num_kv_heads, head_dim).isnan().all(-1).all(-1).cpu(), written)


def test_store_rejects_mismatched_shapes():
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="cache heads"):
        store_kv_cache(torch.zeros(3, 4, 64), torch.zeros(3, 4, 64), cache, cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_cache(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache, cache, torch.zeros(2, dtype=torch.long))
