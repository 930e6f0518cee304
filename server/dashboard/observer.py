"""What the AsyncEngine tells an observer of the engine's traffic (the dashboard's StatsCollector)."""
from __future__ import annotations

from typing import Protocol

from engine.messages import StepOutput


class StepObserver(Protocol):
    def on_submit(self, request_id: str, prompt_token_ids: list[int], arrival: float) -> None: ...
    def on_step(self, output: StepOutput, now: float) -> None: ...
    def on_release(self, request_id: str, now: float, finish_reason: str | None) -> None:
        """The front end let go of the request (finish_reason None: before it finished, i.e. aborted)."""
