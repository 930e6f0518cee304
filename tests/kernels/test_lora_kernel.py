"""The Triton LoRA kernels (kernels/lora.py, the CUDA path) against the torch reference, under the interpreter on
CPU: tokens of several slots and of the base (slot -1) in one launch, odd sizes, fp32 and bf16 outputs."""
from __future__ import annotations

import pytest
import torch

from kernels.lora import lora_expand, lora_ref, lora_shrink
from tests.kernels.paged_cases import DEVICE


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens,k,n,width", [(5, 24, 40, 12), (9, 70, 33, 48), (1, 8, 8, 3)])
def test_shrink_expand_match_the_reference(dtype, tol, num_tokens, k, n, width):
    g = torch.Generator().manual_seed(num_tokens * k)
    slots = 3
    x = torch.randn(num_tokens, k, generator=g).to(dtype).to(DEVICE)
    a = torch.randn(slots, width, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(slots, width, n, generator=g).to(dtype).to(DEVICE)
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g, dtype=torch.int32)
    token_slots[0] = -1                  # the base model's tokens are left as they are
    token_slots = token_slots.to(DEVICE)
    out = torch.randn(num_tokens, n, generator=g).to(dtype).to(DEVICE)
    base_row = out[0].clone()
    want = lora_ref(x, a, b, token_slots, out)
    h = lora_shrink(x, a, token_slots)
    assert torch.equal(h[token_slots < 0], torch.zeros_like(h[token_slots < 0]))
    lora_expand(h, b, token_slots, out)
    scale = want.float().abs().max().item()
    assert torch.allclose(out.float(), want.float(), atol=tol * scale, rtol=tol)
    assert torch.equal(out[0], base_row)
