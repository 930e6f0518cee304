"""LoRARequest: which adapter a request runs with (kept light: the front end imports it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with: its name (the `model` a client asks for), a positive id unique per
    adapter, and its PEFT directory (vLLM's LoRARequest(lora_name, lora_int_id, lora_path))."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}.")
