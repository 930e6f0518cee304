"""The adapters of one step, added to the projections' outputs: y += (x @ A[slot].T) @ B[slot] per token.

Every adapted projection holds a slot table (A [max_loras, W, in], B [max_loras, W, out] with W = S*R;
engine/lora/adapter.py); the step's `token_slots` ([num_tokens], -1 for the base model) say which slot each
token reads. On CPU one GEMM shrinks every token against every slot at once ([T, max_loras * W]: the extra
columns cost little, W is small), then each adapter's tokens (found once per step, shared by every layer)
are expanded from their own slot's columns with one GEMM per adapter in the step: the expand, whose output
is wide, does no work for other slots. On CUDA the Triton kernels of kernels/lora.py read the slot of each token, one shrink
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
        self.groups: list[tuple[int, slice | torch.Tensor]] = []   # CPU: (slot, the rows that read it)

    @property
    def active(self) -> bool:
        return self.token_slots is not None

    def set(self, token_slots: torch.Tensor | None) -> None:
        """token_slots None (or, on CPU, all -1): no adapter in the step, every projection is the base's."""
        if token_slots is not None and token_slots.device.type == "cpu":
            self.groups = _groups(token_slots)
            token_slots = token_slots if self.groups else None
        self.token_slots = token_slots


def _groups(token_slots: torch.Tensor) -> list[tuple[int, slice | torch.Tensor]]:
    """(slot, its rows) per adapter in the step: a slice where the rows are one run (one adapter's
    sequences next to each other), else their indices."""
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot in torch.unique(token_slots).tolist():
        if slot >= 0:
            rows = torch.nonzero(token_slots == slot).flatten()
            first, last = int(rows[0]), int(rows[-1])
            groups.append((slot, slice(first, last + 1) if last - first + 1 == len(rows) else rows))
    return groups


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
        h = self.reduce(x @ self.a_flat.T).to(out.dtype)
        width = self.width
        for slot, rows in self.batch.groups:
            own = h[rows, slot * width:(slot + 1) * width]
            if isinstance(rows, slice):
                out[rows].addmm_(own, self.b[slot])
            else:
                out.index_add_(0, rows, own @ self.b[slot])
        return out
