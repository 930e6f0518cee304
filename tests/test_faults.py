"""The test-only fault hooks (engine/faults.py) on a stand-in engine: what each kind does to the next steps,
and that hold and slow last until release. In-process, no model."""
from __future__ import annotations

import threading

import pytest
import torch

from engine import faults
from engine.faults import FaultInjector, InjectedFault


class _Runner:
    def forward(self, inputs: int) -> torch.Tensor:
        return torch.zeros(2, 8)


class _Engine:
    def __init__(self) -> None:
        self.runner = _Runner()
        self.steps = 0

    def step(self) -> list:
        self.steps += 1
        return ["news"]


@pytest.fixture
def engine() -> _Engine:
    return _Engine()


def test_once_faults_strike_once(engine: _Engine) -> None:
    injector = FaultInjector(engine)
    injector.arm("forward")
    with pytest.raises(InjectedFault):
        engine.runner.forward(0)
    assert torch.equal(engine.runner.forward(0), torch.zeros(2, 8))
    injector.arm("nan")
    assert engine.runner.forward(0).isnan().any()
    assert not engine.runner.forward(0).isnan().any()
    injector.arm("kill")
    with pytest.raises(InjectedFault):
        engine.step()
    assert engine.step() == ["news"] and engine.steps == 1
    injector.arm("no-such-fault")                   # ignored, logged
    assert engine.step() == ["news"]


def test_hold_runs_no_step_until_release(engine: _Engine) -> None:
    injector = FaultInjector(engine)
    injector.arm("hold")
    assert [engine.step() for _ in range(5)] == [[]] * 5 and engine.steps == 0
    injector.arm("kill")                            # a held engine can still be killed
    with pytest.raises(InjectedFault):
        engine.step()
    injector.arm("release")
    assert engine.step() == ["news"] and engine.steps == 1


def test_a_held_step_goes_on_as_soon_as_it_is_released(engine: _Engine) -> None:
    injector = FaultInjector(engine)
    injector.arm("hold")
    entered = threading.Event()
    real_wait = injector._free.wait

    def wait(timeout: float) -> bool:
        entered.set()
        return real_wait(60.0)                      # as if the release came during the step's wait
    injector._free.wait = wait
    result: list = []
    stepper = threading.Thread(target=lambda: result.append(engine.step()))
    stepper.start()
    assert entered.wait(60.0)
    injector.arm("release")
    stepper.join(60.0)
    assert result == [["news"]]


def test_slow_sleeps_before_every_step_until_release(engine: _Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    injector = FaultInjector(engine)
    injector.arm("slow")
    for _ in range(3):
        assert engine.step() == ["news"]
    assert slept == [faults.SLOW_STEP_S] * 3
    injector.arm("release")
    engine.step()
    assert slept == [faults.SLOW_STEP_S] * 3 and engine.steps == 4

