"""An engine's life cycle: asleep, weights awake, fully awake. One state machine, owned by the engine group.

    start ──> FULLY AWAKE ──sleep()──> ASLEEP ──wake_weights()──> WEIGHTS AWAKE ──wake_all()──> FULLY AWAKE
                   ^                     └──────────────wake_all()──────────────────────────────────┘
    load a refit bucket:  WEIGHTS AWAKE or FULLY AWAKE     (asleep, the weights' memory is unmapped)
    generate:             FULLY AWAKE                      (without the KV cache nothing can be scheduled)

Why: vLLM's sleep mode (vllm/device_allocator/cumem.py, `CuMemAllocator.sleep`) copies the allocations tagged
"weights" to the host (level 1) and unmaps every allocation; `wake_up(tags)` maps the tagged ones back (and restores
the weights' copy). A refit into a sleeping engine writes into unmapped memory (CUDA: illegal address, dead engine;
had it landed, the wake-up would restore the old weights), and a sleeping engine's scheduler is paused
(vllm/v1/engine/core.py), so a generation on it never finishes. Hence: a refit wakes the weights first, generation
(training, validation, evaluation, the model server) wakes the KV cache, and a call in the wrong state is an
`EngineStateError` naming the state, never a hang or corrupt weights.

A sleep that a refit follows (`sleep(refit_follows=True)`, GRPO's sleep after its rollouts) may discard the weights
(`discard_sleep`: vLLM's level 2, which copies nothing to the host; only buffers are saved, vllm/v1/worker/
gpu_worker.py `sleep`); after a wake-up the weights' memory then holds garbage until a refit has overwritten every
tensor. The engine `needs_refit` from such a sleep until a complete refit (`refitted`), and waking it to generate
before that is an `EngineStateError` (the run refits it first: mrl/app/engine_restarts.py).

An engine that never sleeps (not colocated, or a platform without sleep mode) stays FULLY AWAKE: `sleep()` keeps it
so and every call is allowed. `history` keeps the last 16 transitions (state, wall time) for logs and tests
(bounded: a long run makes three a step).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import Callable, Optional, Sequence


class EngineState(str, enum.Enum):
    ASLEEP = "asleep"
    WEIGHTS_AWAKE = "weights awake"
    FULLY_AWAKE = "fully awake"


#: vLLM's memory tags (`LLM.wake_up(tags=...)`): what a wake-up maps back.
WEIGHTS, KV_CACHE = "weights", "kv_cache"


class EngineStateError(RuntimeError):
    """A call that the engine's state does not allow (see the module docstring)."""


class EngineLifecycle:
    """The state of one engine (or one group of engines driven together).

    `sleep()` and `wake(tags)` do the platform's work (e.g. `LLM.sleep(level=1)`, `LLM.wake_up(tags=[...])` on every
    engine); they run only on a real transition. `sleeps=False`: the engine never sleeps (see the module docstring).
    """

    def __init__(
        self,
        name: str,
        *,
        sleeps: bool,
        sleep: Callable[[], object] = lambda: None,  # what it returns is ignored (e.g. every worker's answer)
        wake: Callable[[Sequence[str]], None] = lambda tags: None,
        discard_sleep: Optional[Callable[[], object]] = None,
    ) -> None:
        self.name = name
        self.sleeps = sleeps
        self._sleep, self._wake, self._discard_sleep = sleep, wake, discard_sleep
        self.needs_refit = False  # the weights were discarded since the last complete refit: they are garbage
        self.state = EngineState.FULLY_AWAKE
        self.history: deque[tuple[EngineState, float]] = deque([(self.state, time.time())], maxlen=16)

    def _enter(self, state: EngineState) -> None:
        self.state = state
        self.history.append((state, time.time()))

    def sleep(self, refit_follows: bool = False) -> None:
        """Release the engine's memory (weights and KV cache) until the next wake-up; `refit_follows`: a refit will
        rewrite every weight before the next generation, so the weights may be discarded (`discard_sleep`)."""
        if self.sleeps and self.state is not EngineState.ASLEEP:
            discard_sleep = self._discard_sleep if refit_follows else None
            (discard_sleep or self._sleep)()
            self._enter(EngineState.ASLEEP)
            self.needs_refit = self.needs_refit or discard_sleep is not None

    def refitted(self) -> None:
        """A refit has written every weight: discarded weights are whole again."""
        self.needs_refit = False

    def wake_weights(self) -> None:
        """Map the weights back (a refit is about to overwrite them); the KV cache stays released."""
        if self.state is EngineState.ASLEEP:
            self._wake((WEIGHTS,))
            self._enter(EngineState.WEIGHTS_AWAKE)

    def wake_all(self) -> None:
        """Weights and KV cache resident: the engine can generate."""
        if self.needs_refit:
            raise EngineStateError(
                f"{self.name}: its weights were discarded by a level-2 sleep and no refit has "
                "written them since; refit the engine before it generates"
            )
        if self.state is EngineState.ASLEEP:
            self._wake((WEIGHTS, KV_CACHE))
        elif self.state is EngineState.WEIGHTS_AWAKE:
            self._wake((KV_CACHE,))
        else:
            return
        self._enter(EngineState.FULLY_AWAKE)

    def check_load(self, what: str = "a refit bucket") -> None:
        """Raise unless the weights are resident."""
        if self.state is EngineState.ASLEEP:
            raise EngineStateError(
                f"{self.name}: cannot load {what} while the engine is {self.state.value} (its "
                "weights' memory is released); a refit wakes the weights first "
                "(`prepare_for_refit`)"
            )

    def check_generate(self) -> None:
        """Raise unless weights and KV cache are resident."""
        if self.state is not EngineState.FULLY_AWAKE:
            raise EngineStateError(
                f"{self.name}: cannot generate while the engine is {self.state.value} (no KV "
                "cache to schedule on); call `prepare_for_generation()` first"
            )
