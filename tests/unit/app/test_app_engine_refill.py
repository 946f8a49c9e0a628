"""The run's engine wrapper refits an engine whose weights a level-2 sleep discarded before it wakes to generate, when
the run made no refit after that sleep (a step that trained on nothing), and only then (mrl/app/engine_restarts.py,
`RestartingEngine.prepare_for_generation`)."""

from __future__ import annotations

import pytest

from mrl.app.engine_restarts import RestartingEngine
from mrl.inference.lifecycle import EngineLifecycle, EngineState

pytestmark = pytest.mark.unit


class _Engine:
    """The lifecycle calls of an engine group, with a real state machine."""

    def __init__(self, discards: bool) -> None:
        self.lifecycle = EngineLifecycle("engine", sleeps=True, discard_sleep=(lambda: None) if discards else None)

    def prepare_for_generation(self) -> None:
        self.lifecycle.wake_all()

    def finish_generation(self, refit_follows: bool = False) -> None:
        self.lifecycle.sleep(refit_follows)


def _refit(engine: _Engine, log: list[str]):
    def refit() -> None:  # what Runtime.refit does to the engine: weights woken, written, the refit complete
        log.append("refit")
        engine.lifecycle.wake_weights()
        engine.lifecycle.refitted()
    return refit


@pytest.mark.parametrize("discards", [True, False])
def test_a_generation_after_a_discarding_sleep_without_a_refit_gets_one(discards):
    log: list[str] = []
    engine = _Engine(discards)
    wrapped = RestartingEngine(engine, replace=lambda error: None, refill=_refit(engine, log))
    wrapped.finish_generation()  # the start-up sleep: level 1
    wrapped.prepare_for_generation()  # validation at step 0
    wrapped.finish_generation()
    wrapped.prepare_for_generation()  # step 1's rollouts
    wrapped.finish_generation(refit_follows=True)
    _refit(engine, log)()  # the step's own refit after training
    wrapped.prepare_for_generation()  # step 2's rollouts: the weights are whole
    wrapped.finish_generation(refit_follows=True)  # ... and step 2 trains on nothing: no refit
    wrapped.prepare_for_generation()  # step 3's rollouts
    assert engine.lifecycle.state is EngineState.FULLY_AWAKE
    assert log == (["refit", "refit"] if discards else ["refit"])
    assert wrapped.refills == (1 if discards else 0)
