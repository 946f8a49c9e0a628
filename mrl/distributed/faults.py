"""Named fault points: a process that passes one can be made to die there, by SIGKILL, for the fault suite.

    MRL_INJECT_FAULT="engine.generate@2:/tmp/x/killed-1,engine.refit_bucket@3:/tmp/x/killed-2"

kills the process passing `engine.generate` for the 2nd time (counted per process), once: the marker file after the
colon is written first, and a point whose marker exists never fires again (a replacement process counts from zero
and would otherwise die at the same place). The marker holds the point, the hit, the pid and the wall time, so a
test knows where the fault struck and when. Unset (every real run) `inject` is one environment lookup.

The death is real: the kernel's SIGKILL, which no handler sees, as an OOM kill or a node's loss would be. Workers
inherit the variable from the driver (Ray starts them from its own environment).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

ENV = "MRL_INJECT_FAULT"
#: A folder where each worker process leaves a file ROLE-PID (`register`), so that a fault campaign
#: (benchmarks/fault_campaign.py) can kill a process of a chosen role at a random moment.
PIDS_ENV = "MRL_FAULT_PIDS"
_hits: Counter[str] = Counter()


def register(role: str) -> None:
    """Record this process as one of `role` (a worker class's name) where MRL_FAULT_PIDS names a folder; unset (every
    real run), one environment lookup."""
    folder = os.environ.get(PIDS_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{role}-{os.getpid()}").touch()


def inject(point: str) -> None:
    """Die here (SIGKILL) when MRL_INJECT_FAULT names `point` with this pass's count (see the module docstring)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    _hits[point] += 1
    for name, hit, marker in _parse(spec):
        if name == point and hit == _hits[point] and not marker.exists():
            marker.write_text(json.dumps({"point": point, "hit": hit, "pid": os.getpid(), "time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)


def _parse(spec: str) -> list[tuple[str, int, Path]]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            where, marker = item.split(":", 1)
            name, hit = where.split("@", 1)
            faults.append((name, int(hit), Path(marker)))
        except ValueError:
            raise ValueError(
                f"{ENV}={spec!r}: {item!r} is not <point>@<hit>:<marker file> (e.g. engine.generate@2:/tmp/killed)"
            ) from None
    return faults
