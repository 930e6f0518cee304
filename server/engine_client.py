"""The front end's one view of the engine: a typed EngineClient and the frozen ModelInfo it carries.

Requests and aborts go in; one StepOutput per engine step comes back on the event loop (every request's
new tokens, and the engine's stats). The server never holds the engine itself: the real client runs it in
its own process (server/engine_process.py); tests use a scripted one (tests/server/fakes.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.messages import AddRequest, LoRAControl, StepOutput
from engine.model_info import ModelInfo

OnOutput = Callable[[StepOutput], None]
OnDeath = Callable[[str], None]


class EngineClient(Protocol):
    @property
    def info(self) -> ModelInfo: ...

    @property
    def alive(self) -> bool:
        """False once the engine has died or shut down."""

    def start(self, on_output: OnOutput, on_death: OnDeath) -> None:
        """Called on the running event loop: from now on every step's output, and the engine's death (with
        the reason, once), are delivered there."""

    def add(self, request: AddRequest) -> None: ...

    def abort(self, request_id: str, seq_index: int | None = None, finish_reason: str = "abort") -> None: ...

    def control_lora(self, control: LoRAControl) -> None:
        """Loads or unloads a LoRA adapter; the engine answers with a finished delta for its request id."""

    def arm_fault(self, kind: str) -> None:
        """Test-only: arms a fault inside the engine (engine/faults.py), when the engine enabled them."""

    async def shutdown(self, timeout: float) -> None:
        """Stops the engine (it finishes nothing more) and waits up to `timeout` seconds for it to exit."""
