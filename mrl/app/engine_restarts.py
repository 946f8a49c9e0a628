"""Engine restarts: a vLLM engine process that dies while generating or loading a refit is replaced, and the run goes
on as if nothing had happened. The same wrapper refits an engine whose weights a level-2 sleep discarded
(generation.sleep_level) before it is woken to generate, when the run has not refitted it since (after a validation,
or a step that trained on nothing): `prepare_for_generation`.

    engine.generate(...)  --WorkerDiedError of the engine group-->  Runtime.restart_engine:
        every engine actor of the old group stopped (the dead one is gone; the others would hold stale KV caches)
        new engines started on the same bundles from the model's config alone (random weights, no file read)
        the run's watchdog deadlines armed on them
        refit from the policy's current weights (Runtime.refit; a death in this refit is one more restart)
    -> the same generate call again: the same prompts and sampling settings, so where requests are seeded (CPU, or
       generation.seeded_sampling) the samples are those the dead engine would have returned.
    Runtime.refit  --WorkerDiedError of the engine group-->  the engines replaced, then the refit again (once).

At most `generation.max_restarts` replacements in a run (a process's life); past that, or where a restart cannot
reproduce the engine's state, the death ends the run as before (exit 4, "re-running resumes from step N"):
- asynchronous GRPO (grpo.max_off_policy_steps: 1): the engine generates while the policy trains, so the policy's
  weights at the moment of a death are not those the engine held;
- the Megatron engine runs in the driver: its death is the run's.
`train/engine_restarts` (GRPO's metrics) counts the replacements so far.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Callable

from mrl.distributed import WorkerDiedError
from mrl.inference.interface import GenerationOutput, SamplingConfig


class RestartingEngine:
    """The run's rollout engine (a vLLM engine group), replaced through `replace(error)` when it dies in `generate`,
    and refitted through `refill()` when it would wake to generate with discarded weights. Every other attribute is
    the current engine's, so the refit loop and the lifecycle see the engine itself."""

    def __init__(self, engine: Any, replace: Callable[[WorkerDiedError], None],
                 refill: Callable[[], Any] | None = None) -> None:
        self.current = engine
        self._replace = replace
        self._refill = refill
        self.refills = 0  # refits made because a generation found the weights discarded

    def prepare_for_generation(self) -> None:
        if self.current.lifecycle.needs_refit and self._refill is not None:
            self.refills += 1
            self._refill()
        self.current.prepare_for_generation()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> GenerationOutput:
        while True:
            try:
                return self.current.generate(prompts, sampling)
            except WorkerDiedError as error:
                self._replace(error)  # raises `error` when the engine is not to be replaced


def engine_died(error: BaseException, engine: Any) -> bool:
    """Whether `error` is the death of a process of `engine`'s worker group."""
    workers = getattr(engine, "workers", None)
    return isinstance(error, WorkerDiedError) and workers is not None and error.group == workers.name


def restart_refusal(cfg: Any, restarts: int, *, weights_reachable: bool) -> str:
    """Why a dead engine is not replaced ("" when it is). `weights_reachable`: a policy is running to refit new
    engines, or the model's HF files hold their weights."""
    if not weights_reachable:
        return "its weights came from a policy that is no longer running"
    if cfg.grpo.max_off_policy_steps:
        return ("engines are not restarted with grpo.max_off_policy_steps=1 (the policy trains while they generate, "
                "so its weights are not those the engine held)")
    if restarts >= cfg.generation.max_restarts:
        return f"generation.max_restarts={cfg.generation.max_restarts} restart(s) used up"
    return ""


def announce(error: WorkerDiedError, restarts: int, limit: int) -> None:
    where = f" in '{error.method}'" if error.method else ""
    print(f"[mrl] engine rank {error.rank} died{where}; restarting the engines with the policy's current weights "
          f"(restart {restarts} of at most {limit}: generation.max_restarts)", file=sys.stderr, flush=True)
