"""LoRA adapters as models: which names the server answers to (routes: server/lora_routes.py).

A request picks an adapter with `model: NAME`; the base model answers to its served name. Adapters come from
--lora-modules (loaded by the engine at startup) and, with --allow-runtime-lora-updating, from
POST /v1/load_lora_adapter; the engine checks each directory and says why it refuses one (HTTP 400).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from server.errors import APIError, model_not_found


@dataclass
class LoRARegistry:
    base_name: str
    max_loras: int = 0                            # 0: the engine runs without --enable-lora
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)   # names being loaded (a second load of one is refused)

    def __post_init__(self) -> None:
        self._ids = itertools.count(max((a.lora_int_id for a in self.adapters.values()), default=0) + 1)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); unknown names are 404."""
        if not model or model == self.base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise model_not_found(model)
        return adapter

    def new_adapter(self, name: str, path: str) -> LoRARequest:
        if self.max_loras == 0:
            raise APIError(400, "LoRA adapters need the server started with --enable-lora.")
        if name == self.base_name or name in self.adapters or name in self.loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.")
        return LoRARequest(name, next(self._ids), path)

    def cards(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter, for /v1/models."""
        return [(a.lora_name, a.lora_path) for a in self.adapters.values()]
