"""Deadlines: how long the controller waits on a worker group's call before it ends the run as hung.

A hang (a rank stopped or stuck in a collective whose peer is gone, an engine that never answers) otherwise holds
a run silently until the job's wall time runs out. Every call a group dispatches gets a deadline from the work it
carries, unless the caller gives its own timeout:

    seconds = floor_s + tokens / tokens_per_s + bytes / bytes_per_s        (run.watchdog.<method>_s overrides)

`tokens` is what the call computes (training and logprob tokens, prompt plus generated tokens), `bytes` what it
moves (a refit bucket, a checkpoint); the call sites that know them pass `work=Work(...)`
(mrl/distributed/worker_group.py reserves the keyword). The rates are deliberately low (a floor far below what any
supported machine does) so that a deadline only catches a call that has stopped, never a slow one.

A call past its deadline raises `WorkerTimeoutError` naming the group, the late ranks, the method and how long it
waited, with each late rank's Python stack (mrl/distributed/stacks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class Work:
    """What one call computes (`tokens`) and moves (`bytes`), for its deadline."""

    tokens: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class Deadlines:
    """A group's deadline per call (`seconds`); `overrides` maps a method name to its fixed deadline."""

    floor_s: float = 600.0
    tokens_per_s: float = 20.0
    bytes_per_s: float = 10e6
    overrides: Mapping[str, float] = field(default_factory=dict)

    def seconds(self, method: str, work: Optional[Work] = None) -> float:
        if method in self.overrides:
            return float(self.overrides[method])
        work = work or Work()
        return self.floor_s + work.tokens / self.tokens_per_s + work.bytes / self.bytes_per_s
