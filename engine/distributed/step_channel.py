"""Rank 0 -> every other rank: each step's batch metadata, once, as one packed int32 tensor.

A step is two gloo broadcasts on the host: a fixed-size int64 header (kind, the PackedStep header, the
number of KV block copies), then the packed fields with the block copies appended. No per-request
objects are pickled; each rank then makes its own single host->device copy (ModelRunner.unpack).
A LoRA adapter put into a slot (rarely: when a request needs one not in a slot) goes out the same way before
the step that reads it: the slot, then the adapter's name, id and path as JSON; each rank reads its own slice.
"""
from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist

from engine.distributed import parallel_state as ps
from engine.lora.request import LoRARequest
from engine.model_runner import HEADER_LEN, PackedStep

_STEP, _STOP, _LORA = 1, 0, 2
_MSG_HEADER = 2 + HEADER_LEN      # kind, PackedStep.header, number of block copies


class StepChannel:
    def __init__(self) -> None:
        self.group = ps.cpu_group()

    def send_step(self, packed: PackedStep, block_copies: list[tuple[int, int]]) -> None:
        header = np.concatenate(([_STEP], packed.header, [len(block_copies)])).astype(np.int64)
        payload = packed.host
        if block_copies:
            payload = torch.cat((payload, torch.tensor(block_copies, dtype=torch.int32).t().reshape(-1)))
        dist.broadcast(torch.from_numpy(header), 0, group=self.group)
        dist.broadcast(payload, 0, group=self.group)

    def send_lora(self, slot: int, lora: LoRARequest) -> None:
        """Every rank puts this adapter into `slot` of its LoRA tables."""
        data = json.dumps([lora.lora_name, lora.lora_int_id, lora.lora_path]).encode()
        header = np.zeros(_MSG_HEADER, np.int64)
        header[:3] = (_LORA, slot, len(data))
        dist.broadcast(torch.from_numpy(header), 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def send_stop(self) -> None:
        header = torch.zeros(_MSG_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)

    def recv(self) -> tuple[PackedStep, list[tuple[int, int]]] | tuple[int, LoRARequest] | None:
        """The next step, or (slot, adapter) to load (None: rank 0 is shutting down)."""
        header = torch.empty(_MSG_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        values = header.numpy()
        if values[0] == _STOP:
            return None
        if values[0] == _LORA:
            data = torch.empty(int(values[2]), dtype=torch.uint8)
            dist.broadcast(data, 0, group=self.group)
            return int(values[1]), LoRARequest(*json.loads(bytes(data.numpy())))
        num_copies = int(values[-1])
        step_header = values[1:-1].copy()
        payload = torch.empty(int(step_header[5:].sum()) + 2 * num_copies, dtype=torch.int32)
        dist.broadcast(payload, 0, group=self.group)
        n = payload.shape[0] - 2 * num_copies
        copies = payload[n:].view(2, num_copies).t().tolist() if num_copies else []
        return PackedStep(step_header, payload[:n]), [tuple(c) for c in copies]
