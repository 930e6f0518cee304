"""Test-only fault injection, inside the engine process (armed through the front end's /_fault routes).

Off unless PAGEDSERVE_ENABLE_FAULT_INJECTION=1 is in the engine process's environment; then ArmFault
messages arm one fault each. Once only:

  forward  the model's next forward raises once: that batch's requests fail
  nan      the model's next forward returns NaN and +/-inf logits once: sampling must cope
  kill     the engine loop's next step raises out of the engine: the loop dies, the engine process exits

Until `release` (they let a test hold a request in flight, whatever the machine's speed):

  hold     the engine does no work: each step returns nothing (after a short wait). Adds and aborts are
           still taken, and their stats reported, so a test can watch a held engine's queues; the front end
           sees no step completed (a live but stuck engine, for --engine-stall-timeout)
  slow     each step first sleeps SLOW_STEP_S: a request of N tokens takes at least N x SLOW_STEP_S
  release  ends hold and slow

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
ONCE = ("forward", "nan", "kill")
KINDS = (*ONCE, "hold", "slow", "release")
SLOW_STEP_S = 0.05
_HOLD_WAIT_S = 0.01     # a held step waits this long for a release before it returns nothing
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
        self._free = threading.Event()      # cleared while held
        self._free.set()
        self._slow = threading.Event()      # set while slow
        runner = engine.runner
        forward, step = runner.forward, engine.step
        runner.forward = self._wrap_forward(forward)
        engine.step = self._wrap_step(step)

    def arm(self, kind: str) -> None:
        if kind not in KINDS:
            logger.error("fault injection: unknown fault %r ignored", kind)
            return
        logger.warning("fault injection: %s", kind)
        if kind == "hold":
            self._free.clear()
        elif kind == "slow":
            self._slow.set()
        elif kind == "release":
            self._slow.clear()
            self._free.set()
        else:
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
            if not self._free.wait(_HOLD_WAIT_S):
                return []       # held: the loop goes back to its inbox (adds, aborts) and comes here again
            if self._slow.is_set():
                time.sleep(SLOW_STEP_S)
            return step()
        return faulty_step
