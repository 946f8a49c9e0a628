"""Asynchronous GRPO (`grpo.max_off_policy_steps: 1`): the engine generates step n+1 while the policy trains step n.

    step n:  take step n's rollouts (generated during step n-1's training; now, when none is in flight)
             in the background: refit the engine with the policy's newest weights (those after step n-1), then
             generate step n+1's rollouts; wait only until the policy has sent its weights
             train on step n's rollouts                        <- overlaps the engine loading them and generating
So a step's samples come from the policy one update before the one that trains on them (step 1's from the initial
model, like the synchronous loop): `train/staleness` = 1 from step 2 on. The loss corrects for it with its
importance weights against the engine's logprobs (the config requires `loss.importance_sampling`). The engine
needs devices of its own (`generation.colocated: false`): on CPU, the engine and the policy each get their bundle's
cores. The refit's metrics (`timing/refit`, bytes moved) are logged with the rollouts it made, one step later than
the synchronous loop logs them.

Before validation the in-flight generation is waited for (its samples are kept) and the engine gets the newest
weights. A checkpoint waits for it too and stores its rollouts in the train state: a resumed run trains on exactly
the samples the uninterrupted run would have (resume is exact; nothing is regenerated).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from mrl.algorithms.rollout import Rollouts
from mrl.data.datasets import Problem

#: produce(step, problems, policy_version) -> (the step's rollouts, their metrics)
Produce = Callable[[int, list[Problem], int], tuple[Rollouts, dict[str, float]]]
#: refit(on_sent) -> the refit's metrics; `on_sent()` once the policy's weights are all sent (None: not needed)
Refit = Callable[[Optional[Callable[[], None]]], dict[str, float]]


class RolloutsAhead:
    """Step n+1's rollouts generated on a background thread (the engine's calls release the GIL) while step n
    trains; see the module docstring for the order of a step."""

    def __init__(self, produce: Produce, refit: Refit, *, engine_version: int) -> None:
        self._produce, self._refit = produce, refit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mrl-rollouts-ahead")
        self._next: Optional[tuple[int, Future]] = None
        self.engine_version = engine_version
        """The training step whose weights the engine holds (0: the initial model)."""

    def take(self, step: int, problems: Callable[[], list[Problem]]) -> tuple[Rollouts, dict[str, float]]:
        """Step `step`'s rollouts: the ones in flight, or generated now (`problems()` draws its batch) when none is."""
        if self._next is None:
            return self._produce(step, problems(), self.engine_version)
        expected, future = self._next
        if expected != step:
            raise RuntimeError(f"rollouts of step {expected} are in flight, but step {step} asked for its own")
        start = time.perf_counter()
        rollouts, metrics = future.result()
        self._next = None
        return rollouts, {**metrics, "timing/wait_rollouts": time.perf_counter() - start}

    def start(self, step: int, problems: list[Problem], policy_version: int) -> None:
        """In the background, refit the engine to `policy_version` (the policy's weights now) when it holds older
        ones, then generate step `step`'s rollouts. Returns once the policy's weights are sent: training may change
        them from then on, while the engine may still be loading them. The refit's metrics come with the rollouts."""
        if self._next is not None:
            raise RuntimeError(f"rollouts of step {self._next[0]} are still in flight")
        sent, failed = threading.Event(), []

        def refit_then_produce() -> tuple[Rollouts, dict[str, float]]:
            try:
                refit = self._refit_to(policy_version, on_sent=sent.set)
            except BaseException as error:
                failed.append(error)
                raise
            finally:
                sent.set()
            rollouts, metrics = self._produce(step, problems, policy_version)
            return rollouts, {**metrics, **refit}

        self._next = (step, self._pool.submit(refit_then_produce))
        sent.wait()
        if failed:
            raise failed[0]

    def update_engine(self, policy_version: int) -> dict[str, float]:
        """Wait for the generation in flight (its rollouts are kept), then refit the engine to `policy_version`."""
        if self._next is not None:
            self._next[1].result()
        return self._refit_to(policy_version, on_sent=None)

    def _refit_to(self, policy_version: int, on_sent: Optional[Callable[[], None]]) -> dict[str, float]:
        """The engine refitted to `policy_version` unless it holds it already ({} then; `on_sent` is not called)."""
        if self.engine_version == policy_version:
            return {}
        metrics = self._refit(on_sent)
        self.engine_version = policy_version
        return metrics

    def state_dict(self) -> Optional[dict]:
        """The rollouts in flight (waited for), for a checkpoint; None when nothing is in flight."""
        if self._next is None:
            return None
        step, future = self._next
        rollouts, metrics = future.result()
        return {"step": step, "rollouts": rollouts.state_dict(), "metrics": dict(metrics)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Put a checkpoint's in-flight rollouts back in flight (done)."""
        if state is None:
            return
        future: Future = Future()
        future.set_result((Rollouts.from_state_dict(state["rollouts"]), state["metrics"]))
        self._next = (int(state["step"]), future)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
