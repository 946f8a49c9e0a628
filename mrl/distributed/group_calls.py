"""A worker group's pending calls (`GroupFuture`): waiting on every rank at once, and what ends a wait early.

Failure: every wait watches all ranks at once, so the first rank that raises or dies ends the call at once with a
`WorkerError` / `WorkerDiedError` naming the group, the rank and its node/pid -- even while the other ranks are
blocked in a collective waiting for the dead one (they are killed by `shutdown()`). A hang (a rank stopped, or
blocked in a collective whose peer will never come) ends at the call's deadline (`deadlines`, from the work the
caller declares: mrl/distributed/deadlines.py) with a `WorkerTimeoutError` holding each late rank's Python stack.
A rank whose process is gone though Ray has not reported it (a child it forked holds its connection) is found by its
pid on this node, and its orphaned children killed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import ray

from mrl.distributed.errors import WorkerDiedError, WorkerError, WorkerTimeoutError
from mrl.distributed.transport import decode

if TYPE_CHECKING:
    from mrl.distributed.worker_group import WorkerGroup

# How often a wait wakes up when nothing finished; only bounds the overall-timeout check, not failure detection
# (a finished or failed call wakes ray.wait at once).
_POLL_S = 1.0
# Late ranks whose stacks a timeout's message shows (the rest are named).
_STACKS_SHOWN = 8
# After a rank raises, how long to look for a rank that died: a dead peer makes the others' collectives raise
# "connection closed" first, and the death is the error worth reporting.
_DEATH_GRACE_S = 1.0


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    node_ip: str
    node_id: str
    pid: int

    def where(self) -> str:
        return f"node {self.node_ip}, pid {self.pid}"


def _exit_detail(error: BaseException) -> str:
    """Ray's one-line reason ("Worker exit type: ... Worker exit detail: ..."), without its generic advice."""
    text = " ".join(str(error).split())
    start = text.find("Worker exit type")
    detail = text[start:] if start >= 0 else text
    return detail.split(" Some common causes")[0][:300].rstrip(".") or type(error).__name__


def _worker_exception(group: str, method: str, info: WorkerInfo, error: BaseException) -> WorkerError:
    """Turn a Ray error for one rank into our error naming the group, rank and process."""
    who = f"worker group '{group}' rank {info.rank} ({info.where()})"
    if isinstance(error, ray.exceptions.RayActorError):
        if info.pid > 0 and info.node_id == _local_node_id() and _exited(info.pid, within_s=_EXIT_WAIT_S):
            _kill_orphans(info.pid)  # the children it forked, as when the death is found by `_vanished`
        return WorkerDiedError(
            f"{who} died while running '{method}': {_exit_detail(error)}. The group cannot continue; shut it down "
            "and restart (from a checkpoint)",
            group=group,
            rank=info.rank,
            method=method,
        )
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        return WorkerError(
            f"{who} raised {type(cause).__name__} in '{method}': {cause}\n--- remote traceback ---\n{error}",
            cause=cause,
            remote_traceback=str(error),
            group=group,
            rank=info.rank,
            method=method,
        )
    return WorkerError(
        f"{who} failed in '{method}': {error!r}", cause=error, group=group, rank=info.rank, method=method
    )


class GroupFuture:
    """Pending per-rank calls of one group; `result()` waits for all of them and post-processes the values."""

    def __init__(
        self,
        group: WorkerGroup,
        method: str,
        refs: Sequence[ray.ObjectRef],
        ranks: Sequence[int],
        finish: Callable[[list[Any]], Any] = list,
        deadline_s: Optional[float] = None,
        started: Optional[float] = None,
    ):
        self._group = group
        self._method = method
        self._refs = list(refs)
        self._ranks = list(ranks)
        self._finish = finish
        self._values: Optional[list[Any]] = None
        self._deadline_s = deadline_s  # seconds from `started` (the dispatch); None: wait as long as it takes
        self._started = time.monotonic() if started is None else started

    def _end(self, timeout_s: Optional[float], now: float) -> Optional[float]:
        """When waiting ends: `timeout_s` from now if given, else the call's deadline from its dispatch."""
        if timeout_s is not None:
            return now + timeout_s
        return None if self._deadline_s is None else self._started + self._deadline_s

    def done(self) -> bool:
        if self._values is not None:
            return True
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0, fetch_local=False)
        return len(ready) == len(self._refs)

    def then(self, fn: Callable[[Any], Any]) -> "GroupFuture":
        """The same pending calls, their post-processed values passed through `fn` too."""
        return GroupFuture(
            self._group,
            self._method,
            self._refs,
            self._ranks,
            lambda values: fn(self._finish(values)),
            self._deadline_s,
            self._started,
        )

    def result(self, timeout_s: Optional[float] = None) -> Any:
        """Values of the call, post-processed. Raises the first rank's failure as soon as Ray reports it, and
        `WorkerTimeoutError` (with the late ranks' stacks) once `timeout_s`, else the call's deadline, has passed."""
        if self._values is None:
            self._values = _wait_refs([self], timeout_s)[0]
        return self._finish(self._values)


def _wait_refs(futures: Sequence[GroupFuture], timeout_s: Optional[float]) -> list[list[Any]]:
    """Wait on the refs of several futures together, failing on the first error of any of them, or once one of them
    is past its end (`GroupFuture._end`)."""
    owner: dict[ray.ObjectRef, tuple[int, int]] = {}
    for f_index, future in enumerate(futures):
        for slot, ref in enumerate(future._refs):
            owner[ref] = (f_index, slot)
    values: list[list[Any]] = [[None] * len(future._refs) for future in futures]
    pending = list(owner)
    now = time.monotonic()
    ends = [future._end(timeout_s, now) for future in futures]
    while pending:
        soonest = min((end for end in ends if end is not None), default=None)
        wait_s = _POLL_S if soonest is None else max(0.0, min(_POLL_S, soonest - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        for ref in ready:
            f_index, slot = owner[ref]
            future = futures[f_index]
            try:
                values[f_index][slot] = decode(ray.get(ref))
            except Exception as error:
                if not isinstance(error, ray.exceptions.RayActorError):
                    # A peer's death makes the others' collectives fail too; report the death, the root cause.
                    ref, error = _find_death(pending, _DEATH_GRACE_S) or (ref, error)
                    f_index, slot = owner[ref]
                    future = futures[f_index]
                consume_errors([other for other in pending if other != ref])
                info = future._group.info[future._ranks[slot]]
                raise _worker_exception(future._group.name, future._method, info, error) from error
        gone = _vanished(futures, owner, pending)
        if gone is not None:
            consume_errors(pending)
            raise gone
        now = time.monotonic()
        late = [
            i
            for i, end in enumerate(ends)
            if end is not None and now >= end and any(owner[ref][0] == i for ref in pending)
        ]
        if pending and late:
            future = futures[late[0]]
            ranks = sorted(future._ranks[owner[ref][1]] for ref in pending if owner[ref][0] == late[0])
            limit = timeout_s if timeout_s is not None else future._deadline_s
            raise _timeout_error(future, ranks, now - future._started, float(limit or 0.0))
    return values


def _vanished(
    futures: Sequence[GroupFuture], owner: dict[ray.ObjectRef, tuple[int, int]], pending: Sequence[ray.ObjectRef]
) -> Optional[WorkerDiedError]:
    """The death of a rank whose call is pending and whose process is gone from this node, though Ray has not reported
    it: a child the worker forked (megatron-core's checkpoint writers fork, `filesystem_async.py`) keeps the worker's
    connection to Ray open, so Ray never sees it die and the call would wait for its deadline. The dead worker's
    process group (its orphaned children) is killed, and the error is the one a death reported by Ray gives."""
    local = _local_node_id()
    for ref in pending:
        f_index, slot = owner[ref]
        future = futures[f_index]
        info = future._group.info[future._ranks[slot]]
        if info.pid <= 0 or info.node_id != local or _process_alive(info.pid):
            continue
        _kill_orphans(info.pid)
        return WorkerDiedError(
            f"worker group '{future._group.name}' rank {info.rank} ({info.where()}) died while running "
            f"'{future._method}': its process is gone (killed, or out of memory). The group cannot continue; shut it "
            "down and restart (from a checkpoint)",
            group=future._group.name,
            rank=info.rank,
            method=future._method,
        )
    return None


def _local_node_id() -> Optional[str]:
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 no Ray context (a test's stand-in): nothing is local
        return None


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


#: How long a worker Ray reports dead may still take to exit. Ray can learn of the death from the worker's closed
#: connection, and the kernel closes a process's files before it ends it (`do_exit`: exit_files before
#: exit_notify): on a loaded machine the process still shows as running for a moment after Ray's report.
_EXIT_WAIT_S = 2.0


def _exited(pid: int, within_s: float) -> bool:
    """Whether process `pid` is gone (or a zombie) within `within_s` seconds."""
    end = time.monotonic() + within_s
    while _process_alive(pid):
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)
    return True


def _kill_orphans(pid: int) -> None:
    """SIGKILL the process group a dead Ray worker led (Ray starts each worker as its group's leader): the children
    it forked, which would otherwise live on holding its memory and its connection to Ray."""
    import os
    import signal

    try:
        if os.getpgid(os.getpid()) != pid:  # never this process's own group
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _timeout_error(future: GroupFuture, ranks: list[int], waited_s: float, limit_s: float) -> WorkerTimeoutError:
    """The error of a call past its end: the group, ranks, method, the wait, and each late rank's stack."""
    from mrl.distributed.stacks import stacks_of

    group = future._group
    group.hung = True  # its shutdown asks no clean-up of ranks that do not answer
    shown = [rank for rank in ranks if group.info[rank].pid > 0][:_STACKS_SHOWN]
    dumps = stacks_of([(group.info[rank].node_id, group.info[rank].pid) for rank in shown]) if shown else []
    text = "".join(
        f"\n--- stack of rank {rank} ({group.info[rank].where()}) ---\n{dump}" for rank, dump in zip(shown, dumps)
    )
    return WorkerTimeoutError(
        f"worker group '{group.name}': '{future._method}' did not finish within {limit_s:g} s on ranks {ranks} "
        f"(waited {waited_s:.0f} s; a hang: a stopped rank, or a collective waiting for one){text}",
        group=group.name,
        rank=ranks[0],
        method=future._method,
    )


def _find_death(refs: Sequence[ray.ObjectRef], grace_s: float) -> Optional[tuple[ray.ObjectRef, Exception]]:
    """The first of `refs` whose actor died, looking for at most `grace_s`; None if none did."""
    deadline = time.monotonic() + grace_s
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as error:
                return ref, error
            except Exception:  # noqa: BLE001 -- another ordinary failure: keep looking for a death
                pass
    return None


def consume_errors(refs: Sequence[ray.ObjectRef]) -> None:
    """Fetch the refs of other ranks that already failed too, so that Ray does not log each of them as an
    'unhandled error' once we raise for the first. Best effort: ranks still running are left alone."""
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.2) if refs else ([], [])
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 -- the first failure is the one reported
            pass


def wait_all(futures: Sequence[GroupFuture], timeout_s: Optional[float] = None) -> list[Any]:
    """Results of several futures (possibly of different groups) waited on together: a failure in any group is
    raised at once instead of after the futures before it finish."""
    all_values = _wait_refs(futures, timeout_s)
    for future, values in zip(futures, all_values):
        future._values = values
    return [future.result() for future in futures]


def result_watching(future: GroupFuture, watched: Sequence[GroupFuture]) -> Any:
    """`future.result()`, but a failure of any of `watched` that ends first is raised at once (a broadcast's sender
    waits this way on its receivers: one that died would leave it blocked). `watched` stay pending otherwise."""
    refs = future._refs
    end = future._end(None, time.monotonic())
    while len(ray.wait(refs, num_returns=len(refs), timeout=0.01, fetch_local=False)[0]) < len(refs):
        for other in watched:
            if other.done():
                other.result()  # raises its failure; a success is kept for the caller's own result()
        if end is not None and time.monotonic() >= end:
            break  # result() below raises the timeout
    return future.result()
