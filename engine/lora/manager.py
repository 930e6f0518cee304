"""Adapters known, adapters loaded on the host (--max-cpu-loras, least recently used dropped first) and the
--max-loras slots of the model's tables. Owned by the engine thread.

The scheduler never runs more than max_loras distinct adapters at once (engine/scheduler.py), so every running
adapter has a slot; an adapter leaves its slot only when no running sequence uses it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.lora.adapter import PROJECTIONS, LoRARequest, LoRAWeights, load_adapter, num_subprojections
from engine.lora.layers import LoRABatch, LoRAProjection
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.request import Request, Sequence


def attach_lora(cfg: EngineConfig, runner: ModelRunner, device: torch.device,
                on_write: Callable[[int, LoRARequest], None] | None = None) -> LoRAManager | None:
    """With enable_lora: slot tables in the runner's model, and the runner told of each step's adapters."""
    if not cfg.enable_lora:
        return None
    manager = LoRAManager(runner.model, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras or cfg.max_loras,
                          cfg.torch_dtype, device, on_write)
    runner.lora_batch = manager.batch
    if runner.graphs is not None:     # before capture: the graphs then hold the LoRA kernels
        runner.graphs.lora_batch = manager.batch
    return manager


def startup_adapters(cfg: EngineConfig) -> tuple[LoRARequest, ...]:
    """The --lora-modules adapters, ids 1, 2, ... in their order."""
    return tuple(LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(cfg.lora_modules))


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device,
                 on_write: Callable[[int, LoRARequest], None] | None = None) -> None:
        """on_write: told of every adapter put into a slot (tensor parallelism: the other ranks do the same)."""
        self.on_write = on_write
        self.cfg: ModelConfig = model.full_config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = dtype
        self.batch = LoRABatch(max_loras)
        self.projections: dict[tuple[int, str], LoRAProjection] = {}
        for i, layer in enumerate(model.layers):
            for name in PROJECTIONS:
                module = getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
                proj = LoRAProjection(self.batch, max_loras, num_subprojections(name) * max_lora_rank,
                                      module.in_features, module.out_features, name in ("o_proj", "down_proj"),
                                      dtype, device)
                module.lora = proj
                self.projections[i, name] = proj
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()    # by lora_int_id, least recent first
        self.slots: list[int | None] = [None] * max_loras              # lora_int_id in each slot

    def add(self, request: LoRARequest) -> LoRAWeights:
        """Loads (or finds) the adapter on the host; ValueError when its directory is not a usable adapter."""
        weights = self.loaded.get(request.lora_int_id)
        if weights is not None and weights.request == request:
            self.loaded.move_to_end(request.lora_int_id)
            return weights
        weights = load_adapter(request, self.cfg, self.max_lora_rank, self.dtype)
        self.loaded[request.lora_int_id] = weights
        if weights is not None and request.lora_int_id in self.slots:   # the id now names another adapter
            self.slots[self.slots.index(request.lora_int_id)] = None
        in_slots = set(self.slots)
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if lora_id not in in_slots and lora_id != request.lora_int_id:
                del self.loaded[lora_id]
        return weights

    def start(self, adapters: Iterable[LoRARequest], on_write: Callable[[int, LoRARequest], None] | None) -> None:
        """Loads the startup adapters (a broken one raises ValueError with the reason); on_write: see __init__."""
        if on_write is not None:      # tensor parallelism: the other ranks fill their slots too
            self.on_write = on_write
        for lora in adapters:
            self.add(lora)

    def remove_unused(self, lora_int_id: int, requests: Iterable[Request]) -> None:
        """Forgets the adapter unless one of the engine's requests still uses it (ValueError then)."""
        if any(r.lora_id == lora_int_id for r in requests):
            raise ValueError("the adapter still has requests in flight; abort them or wait for them first.")
        self.remove(lora_int_id)

    def remove(self, lora_int_id: int) -> None:
        """Forgets the adapter (its slot is freed; the caller has no running request on it)."""
        self.loaded.pop(lora_int_id, None)
        if lora_int_id in self.slots:
            self.slots[self.slots.index(lora_int_id)] = None

    def needs_write(self, running: set[int]) -> bool:
        """Whether activating the running adapters writes a slot (a step in flight must finish first)."""
        return not running <= set(self.slots)

    def activate_running(self, running: Iterable[Sequence], before_write: Callable[[], None]) -> None:
        """Slots for the running sequences' adapters; before_write resolves the step in flight (which may read a
        slot) and is called only when a slot is to be rewritten."""
        requests = {s.request.lora_id: s.request.lora for s in running if s.request.lora_id}
        if self.needs_write(set(requests)):
            before_write()
            self.activate(set(requests), requests)

    def activate(self, running: set[int], requests: dict[int, LoRARequest]) -> None:
        """Gives every running adapter a slot, taking slots from adapters no running sequence uses."""
        for lora_id in running - set(self.slots):
            slot = next(i for i, held in enumerate(self.slots) if held is None or held not in running)
            if self.on_write is not None:
                self.on_write(slot, requests[lora_id])
            self.write_slot(slot, requests[lora_id])

    def write_slot(self, slot: int, request: LoRARequest) -> None:
        """Puts the adapter (this rank's slice of it) into a slot of every projection's table."""
        weights = self.add(request)
        for key, proj in self.projections.items():
            a, b = weights.pairs.get(key, (None, None))
            proj.write(slot, a, b)
        self.slots[slot] = request.lora_int_id

    def slot_array(self, lora_ids: list[int]) -> np.ndarray:
        """The slot of each scheduled sequence's adapter (-1: the base model)."""
        index = {lora_id: i for i, lora_id in enumerate(self.slots) if lora_id is not None}
        return np.fromiter((index[i] if i else -1 for i in lora_ids), np.int64, len(lora_ids))

    @staticmethod
    def in_use(running: Iterable[Sequence], waiting: Iterable[Sequence]) -> tuple[list[str], list[str]]:
        """Names of the adapters with running sequences, and of those with waiting sequences only."""
        run = {s.request.lora.lora_name for s in running if s.request.lora is not None}
        wait = {s.request.lora.lora_name for s in waiting if s.request.lora is not None}
        return sorted(run), sorted(wait - run)
