"""The adapters of one step, added to the projections' outputs: y += (x @ A[slot].T) @ B[slot].T per token.

Every adapted projection holds a slot table (A [max_loras, S*R, in], B [max_loras, out, S*R]; engine/lora/
adapter.py); the step's `token_slots` ([num_tokens], -1 for the base model) say which slot each token reads.
On CPU the tokens of each active slot are gathered (at most --max-loras groups per step, found once per step
and shared by every layer) and run as two small GEMMs, in the spirit of punica's SGMV; on CUDA the Triton
kernels of kernels/lora.py read the slot of each token, one shrink and one expand per projection, with no
host sync (so the step can be graph-captured).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.distributed import parallel_state as ps


class LoRABatch:
    """Which slot each token of the current step reads; set by the model runner before the forward."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None
        self.groups: list[tuple[int, slice | torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return self.token_slots is not None

    def set(self, token_slots: torch.Tensor | None) -> None:
        """token_slots None (or all -1): no adapter in the step, every projection is the base's."""
        if token_slots is not None and token_slots.device.type == "cpu":
            self.groups = _groups(token_slots)
            token_slots = token_slots if self.groups else None
        self.token_slots = token_slots


def _groups(token_slots: torch.Tensor) -> list[tuple[int, slice | torch.Tensor]]:
    """(slot, the rows that read it): a slice where the rows are one run (sequences are contiguous in the
    batch, so usually), else their indices."""
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).flatten()
        first, last = int(rows[0]), int(rows[-1])
        groups.append((slot, slice(first, last + 1) if last - first + 1 == len(rows) else rows))
    return groups


class LoRAProjection:
    """One projection's slot table and its share of the step's batch."""

    def __init__(self, batch: LoRABatch, max_loras: int, width: int, in_features: int, out_features: int,
                 row_parallel: bool, dtype: torch.dtype, device: torch.device) -> None:
        self.batch = batch
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)
        # Row-parallel layers see a slice of the input: the shrink is a partial sum, all-reduced before expand.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = ps.all_reduce if row_parallel else (lambda h: h)

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """The adapter's pair into its slot (None: it does not adapt this projection)."""
        if a is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b)

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
        for slot, rows in self.batch.groups:
            h = self.reduce(x[rows] @ self.a[slot].T)
            if isinstance(rows, slice):
                out[rows] += h @ self.b[slot].T
            else:
                out.index_add_(0, rows, h @ self.b[slot].T)
        return out
