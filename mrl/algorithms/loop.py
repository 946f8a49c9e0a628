"""The end of a step, shared by every training loop (SFT, DPO, reward models, GRPO's two schedules).

In this order: the step's wall time (`timing/step`), its log line, the stops (a guard whose count is exhausted
raises here, before the save: the stopped step's checkpoint would only renumber where a re-run starts), the
checkpoint when one is due, and whether the loop ends (it is done, or a SIGTERM arrived: `LoopCheckpoints`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

from mrl.algorithms.interfaces import LoopCheckpoints
from mrl.logging.metrics import MetricsLogger


class Stop(Protocol):
    """A guard that ends the run once its count of bad steps in a row is reached (mrl/algorithms/guards.py,
    mrl/algorithms/health.py)."""

    def stop_if_exhausted(self) -> None: ...


def end_step(
    step: int,
    last: int,
    metrics: dict[str, float],
    *,
    started: float,
    done: bool,
    logger: MetricsLogger,
    ckpt: LoopCheckpoints,
    stops: Sequence[Stop],
    state: Callable[[], dict[str, Any]],
) -> bool:
    """Log step `step` (begun at `started`, `time.perf_counter()`), raise a guard's stop, save when due (`state()`:
    the loop's controller state, asked only then: GRPO's one-step-ahead schedule waits for its generation in flight to
    give it) and say whether the loop ends after this step."""
    metrics["timing/step"] = time.perf_counter() - started
    logger.log(metrics, step=step)
    for stop in stops:
        stop.stop_if_exhausted()
    if ckpt.due(step, last, final=done):
        ckpt.save(step, state(), metrics)
    return ckpt.stops_after(step, done=done)
