"""Test-only fault injection, inside the engine process (armed through the front end's /_fault routes).

Off unless PAGEDSERVE_ENABLE_FAULT_INJECTION=1 is in the engine process's environment; then ArmFault
messages arm one fault each:

  forward  the model's next forward raises once: that batch's requests fail
  nan      the model's next forward returns NaN and +/-inf logits once: sampling must cope
  kill     the engine loop's next step raises out of the engine: the loop dies, the engine process exits
  stall    the engine loop's next step blocks for STALL_S seconds (a live but stuck engine)

The hooks wrap the engine's own objects (the model runner's forward, the engine's step) from outside, so
the engine carries no test code.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

ENV_VAR = "PAGEDSERVE_ENABLE_FAULT_INJECTION"
KINDS = ("forward", "nan", "kill", "stall")
STALL_S = 3.0
logger = logging.getLogger("pagedserve.engine")


class InjectedFault(RuntimeError):
    """Raised by an armed fault."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(ENV_VAR, "") == "1"


def poison(logits: torch.Tensor) -> torch.Tensor:
    """Every other logit NaN, one +inf and one -inf per row: what a numerically broken model returns."""
    bad = logits.clone()
    bad[:, 0::2] = float("nan")
    bad[:, 1] = float("inf")
    if bad.shape[1] > 3:
        bad[:, 3] = float("-inf")
    return bad


class FaultInjector:
    def __init__(self, engine: Any) -> None:
        self._armed: set[str] = set()
        self._lock = threading.Lock()       # armed by the engine process's input thread, taken by the loop
        runner = engine.runner
        forward, step = runner.forward, engine.step
        runner.forward = self._wrap_forward(forward)
        engine.step = self._wrap_step(step)

    def arm(self, kind: str) -> None:
        if kind not in KINDS:
            logger.error("fault injection: unknown fault %r ignored", kind)
            return
        logger.warning("fault injection: %s armed", kind)
        with self._lock:
            self._armed.add(kind)

    def _take(self, kind: str) -> bool:
        with self._lock:
            if kind in self._armed:
                self._armed.discard(kind)
                return True
            return False

    def _wrap_forward(self, forward: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        def faulty_forward(inputs: Any) -> torch.Tensor:
            if self._take("forward"):
                raise InjectedFault("injected forward failure")
            logits = forward(inputs)
            return poison(logits) if self._take("nan") else logits
        return faulty_forward

    def _wrap_step(self, step: Callable[[], list]) -> Callable[[], list]:
        def faulty_step() -> list:
            if self._take("kill"):
                raise InjectedFault("injected engine thread death")
            if self._take("stall"):
                time.sleep(STALL_S)
            return step()
        return faulty_step
