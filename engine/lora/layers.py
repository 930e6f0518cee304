"""The adapters of one step, added to the projections' outputs: y += (x @ A[slot].T) @ B[slot] per token.

Every adapted projection holds a slot table (A [max_loras, W, in], B [max_loras, W, out] with W = S*R;
engine/lora/adapter.py); the step's `token_slots` ([num_tokens], -1 for the base model) say which slot each
token reads. On CPU one GEMM shrinks every token against every slot at once ([T, max_loras * W]), a mask
built once per step keeps each token's own slot's columns (zero for the base), and one GEMM expands them
into the output: two GEMMs per projection whatever the mix of adapters (the slots' extra rank columns cost
little: W is small). On CUDA the Triton kernels of kernels/lora.py read the slot of each token, one shrink
and one expand per projection, with no host sync (so the step can be graph-captured).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.distributed import parallel_state as ps


class LoRABatch:
    """Which slot each token of the current step reads; set by the model runner before the forward."""

    def __init__(self, max_loras: int = 1) -> None:
        self.max_loras = max_loras
        self.token_slots: torch.Tensor | None = None
        self._one_hot: torch.Tensor | None = None          # [T, max_loras, 1]: the slot each token reads
        self._masks: dict[int, torch.Tensor] = {}          # rank width W -> [T, max_loras * W]

    @property
    def active(self) -> bool:
        return self.token_slots is not None

    def set(self, token_slots: torch.Tensor | None) -> None:
        """token_slots None (or, on CPU, all -1): no adapter in the step, every projection is the base's."""
        self._masks.clear()
        if token_slots is not None and token_slots.device.type == "cpu":
            if not bool((token_slots >= 0).any()):
                token_slots = None
            else:
                slots = token_slots.long()
                self._one_hot = (slots[:, None] == torch.arange(self.max_loras)).unsqueeze(-1)
        self.token_slots = token_slots

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, max_loras * width]: 1 in the columns of each token's slot, else 0 (shared by the layers)."""
        mask = self._masks.get(width)
        if mask is None or mask.dtype != dtype:
            mask = self._one_hot.expand(-1, -1, width).reshape(self._one_hot.shape[0], -1).to(dtype)
            self._masks[width] = mask
        return mask


class LoRAProjection:
    """One projection's slot table and its share of the step's batch."""

    def __init__(self, batch: LoRABatch, max_loras: int, width: int, in_features: int, out_features: int,
                 row_parallel: bool, dtype: torch.dtype, device: torch.device) -> None:
        self.batch, self.width = batch, width
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        # Every slot side by side: one GEMM for all of them (views of the tables, so slot writes show)
        self.a_flat = self.a.view(max_loras * width, in_features)
        self.b_flat = self.b.view(max_loras * width, out_features)
        # Row-parallel layers see a slice of the input: the shrink is a partial sum, all-reduced before expand.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = ps.all_reduce if row_parallel else (lambda h: h)

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """The adapter's pair (A [W, in], B [out, W]) into its slot (None: it does not adapt this projection)."""
        if a is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b.T)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + the adapters' terms of x's tokens (out is updated in place and returned)."""
        slots = self.batch.token_slots
        if slots is None:
            return out
        if out.device.type == "cuda":
            from kernels.lora import lora_expand, lora_shrink
            h = self.reduce(lora_shrink(x, self.a, slots))
            lora_expand(h, self.b, slots, out)
            return out
        h = self.reduce(x @ self.a_flat.T) * self.batch.mask(self.width, x.dtype)
        return out.addmm_(h.to(out.dtype), self.b_flat)
