"""The Python stack of a worker that does not answer, for the message of a call past its deadline.

Data flow:
    worker start: `register()` -- faulthandler writes every thread's stack to a file on SIGUSR1 (a C-level handler:
                  it runs while the main thread is blocked in a collective, holding no GIL). The file is unlinked
                  as soon as it is open, so nothing is left behind however the worker ends (SIGKILL included);
                  it stays reachable as /proc/<pid>/fd/<n>, whose link names it <tmp>/mrl-stack-<pid>-*.txt
    controller, at a deadline: `stacks_of([(node_id, pid), ...])` -- one Ray task per worker, pinned to its node
                  (NodeAffinitySchedulingStrategy, so this works across nodes), sends SIGUSR1, waits for the file
                  to fill and returns it; a process that cannot run its handler (stopped by SIGSTOP, a zombie) is
                  named by its state instead.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import IO, Optional, Sequence

import ray

_STACK_SIGNAL = signal.SIGUSR1
_WAIT_S = 3.0  # how long a task waits for the handler's output
_MAX_CHARS = 6000  # of one worker's stacks in a message
_file: Optional[IO[str]] = None  # kept open for faulthandler, which writes to its file descriptor


def _prefix(pid: int) -> str:
    return f"mrl-stack-{pid}-"


def register() -> None:
    """In a worker process: dump every thread's stack to an unlinked file on SIGUSR1 (idempotent)."""
    global _file
    if _file is None:
        _file = tempfile.NamedTemporaryFile("w", prefix=_prefix(os.getpid()), suffix=".txt", delete=False)
        os.unlink(_file.name)  # the open descriptor keeps it; /proc/<pid>/fd/<n> reaches it (`stack_file`)
        faulthandler.register(_STACK_SIGNAL, file=_file, all_threads=True, chain=False)


def stack_file(pid: int) -> Optional[Path]:
    """Process `pid`'s stack file as /proc/<pid>/fd/<n> (None: it registered none, or it is gone)."""
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    for descriptor in descriptors:
        try:
            target = os.readlink(descriptor)
        except OSError:
            continue
        if Path(target.removesuffix(" (deleted)")).name.startswith(_prefix(pid)):
            return descriptor
    return None


def _dump(pid: int) -> str:
    """On the worker's node: its stacks, or why there are none."""
    import psutil

    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return "no stack: the process is gone"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE):
        return f"no stack: the process is {status} (it cannot run; a SIGSTOP, a debugger or a dead process)"
    path = stack_file(pid)
    if path is None:
        return "no stack: the worker registered no stack dump"
    before = path.stat().st_size
    os.kill(pid, _STACK_SIGNAL)
    deadline = time.monotonic() + _WAIT_S
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = path.stat().st_size
        if now > before and now == size:  # written and no longer growing
            break
        size = now
    with open(path, errors="replace") as f:
        f.seek(before)
        text = f.read()
    return text.strip() or f"no stack: the process ({status}) did not answer SIGUSR1 within {_WAIT_S:g} s"


def stacks_of(workers: Sequence[tuple[str, int]], timeout_s: float = 20.0) -> list[str]:
    """The stacks of the workers (node id, pid), in order; a worker whose node does not answer says so."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_dump)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid)
        for node, pid in workers
    ]
    out = []
    for ref in refs:
        try:
            text = ray.get(ref, timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 -- the node or Ray is gone: the message still goes out
            text = f"no stack: {type(error).__name__}: {error}"
        out.append(text if len(text) <= _MAX_CHARS else "...\n" + text[-_MAX_CHARS:])
    return out
