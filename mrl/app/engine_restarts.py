"""Engine restarts: a vLLM engine that dies at any point of its life is replaced, and the run goes on as if nothing had
happened. One mechanism covers every call the run makes to its engines:

    every engine call of the loops (RestartingEngine._covered: generate, prepare_for_generation (the wake-up),
    finish_generation (the sleep), and the diagnostics)
        --WorkerDiedError of the engine group-->  Runtime.restart_engine:
            every engine actor of the old group stopped (the dead one is gone; the others would hold stale KV caches)
            new engines started on the same bundles from the model's config alone (random weights, no file read)
            the run's watchdog deadlines armed on them
            refit from the policy's current weights (Runtime.refit; a death in this refit is one more restart)
        -> the same call again, on the new engines: the same prompts and sampling settings, so where requests are
           seeded (CPU, or generation.seeded_sampling) the samples are those the dead engine would have returned;
           a wake-up or sleep is made again from the state the refit left (awake).
    a refit (Runtime.refit: every bucket, the wake-up of the weights before them, the close after)
        --WorkerDiedError of the engine group-->  the engines replaced, then the whole refit again (never one bucket:
        the new engines hold none of the earlier ones).
    the start (Runtime._new_engine: the run's first engines, their first sleep, and every replacement)
        --WorkerDiedError-->  the engines started again.

Each replacement, a failed start included, is one restart; at most `generation.max_restarts` in a run (a process's
life). Past that, or where a restart cannot reproduce the engine's state, the death ends the run as before (exit 4,
one message, "re-running resumes from step N"):
- asynchronous GRPO (grpo.max_off_policy_steps: 1): the engine generates while the policy trains, so the policy's
  weights at the moment of a death are not those the engine held (its start is restarted: nothing was generated);
- the Megatron engine runs in the driver: its death is the run's.
`train/engine_restarts` (GRPO's metrics) counts the replacements so far.

The same wrapper refits an engine whose weights a level-2 sleep discarded (generation.sleep_level) before it is woken
to generate, when the run has not refitted it since (after a validation, or a step that trained on nothing).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

from mrl.distributed import WorkerDiedError
from mrl.inference.interface import GenerationOutput, SamplingConfig

T = TypeVar("T")


class RestartingEngine:
    """The run's rollout engine (a vLLM engine group): every call of the loops goes through `_covered`, which has the
    engine replaced through `replace(error)` when it dies in the call, and makes the call again on the replacement;
    `refill()` refits it when it would wake to generate with discarded weights. Every other attribute is the current
    engine's, so the refit loop (covered as a whole by `Runtime.refit`) and the lifecycle see the engine itself."""

    def __init__(
        self, engine: Any, replace: Callable[[WorkerDiedError], None], refill: Callable[[], Any] | None = None
    ) -> None:
        self.current = engine
        self._replace = replace
        self._refill = refill
        self.refills = 0  # refits made because a generation found the weights discarded

    def _covered(self, call: Callable[[Any], T]) -> T:
        """`call(engine)` on the current engine; when the engine dies in it, `replace` (which raises the death when
        the engine is not to be replaced), then `call` again on the new engine."""
        while True:
            try:
                return call(self.current)
            except WorkerDiedError as error:
                self._replace(error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> GenerationOutput:
        return self._covered(lambda engine: engine.generate(prompts, sampling))

    def prepare_for_generation(self) -> None:
        # The refill is a refit (covered by Runtime.refit); a replacement is refitted, so it never needs one.
        if self.current.lifecycle.needs_refit and self._refill is not None:
            self.refills += 1
            self._refill()
        self._covered(lambda engine: engine.prepare_for_generation())

    def finish_generation(self, refit_follows: bool = False) -> None:
        self._covered(lambda engine: engine.finish_generation(refit_follows))

    def sleep_events(self) -> Any:
        return self._covered(lambda engine: engine.sleep_events())

    def worker_uss_bytes(self) -> Any:
        return self._covered(lambda engine: engine.worker_uss_bytes())


def engine_died(error: BaseException, engine: Any) -> bool:
    """Whether `error` is the death of a process of `engine`'s worker group."""
    workers = getattr(engine, "workers", None)
    return isinstance(error, WorkerDiedError) and workers is not None and error.group == workers.name


def restart_refusal(cfg: Any, restarts: int, *, weights_reachable: bool, starting: bool = False) -> str:
    """Why a dead engine is not replaced ("" when it is). `weights_reachable`: a policy is running to refit new
    engines, or the model's HF files hold their weights; `starting`: the engine died before it generated anything
    (the run's start), so no weights it held can be lost."""
    if not weights_reachable:
        return "its weights came from a policy that is no longer running"
    if cfg.grpo.max_off_policy_steps and not starting:
        return (
            "engines are not restarted with grpo.max_off_policy_steps=1 (the policy trains while they generate, "
            "so its weights are not those the engine held)"
        )
    if restarts >= cfg.generation.max_restarts:
        return f"generation.max_restarts={cfg.generation.max_restarts} restart(s) used up"
    return ""


def announce(error: WorkerDiedError, restarts: int, limit: int, *, how: str) -> None:
    """One line for a restart (`how`: where the new engines' weights come from)."""
    where = f" in '{error.method}'" if error.method else ""
    print(
        f"[mrl] engine rank {error.rank} died{where}; restarting the engines {how} "
        f"(restart {restarts} of at most {limit}: generation.max_restarts)",
        file=sys.stderr,
        flush=True,
    )
