"""A worker group: one Ray actor per rank, built from a plain Python worker class, driven by one controller.

The controller never handles ranks: it calls `run_all` (every rank, same arguments), `run_on_leaders` (one rank per
data-parallel group) or `shard_and_run` (the batch split over data-parallel ranks, results gathered back in batch
order), or their `_async` variants, which return a `GroupFuture` so that several groups can work at once.

Rank r runs on bundle r of its placement with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, OMP_NUM_THREADS set
at process start, and MASTER_ADDR/MASTER_PORT (rank 0's node and a port found free there, once per group) set
before the worker class is built, so `torch.distributed.init_process_group(init_method="env://")` works inside
its __init__ or any later method. On GPUs, Ray sets CUDA_VISIBLE_DEVICES to the bundle's device.

Failure: every wait watches all ranks at once, so the first rank that raises or dies ends the call at once with a
`WorkerError` / `WorkerDiedError` naming the group, the rank and its node/pid -- even while the other ranks are
blocked in a collective waiting for the dead one (they are killed by `shutdown()`). A hang (a rank stopped, or
blocked in a collective whose peer will never come) ends at the call's deadline (`deadlines`, from the work the
caller declares: mrl/distributed/deadlines.py) with a `WorkerTimeoutError` holding each late rank's Python stack.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mrl.distributed.batch import merge_shards, split_batch
from mrl.distributed.cluster import Placement
from mrl.distributed.deadlines import Deadlines, Work
from mrl.distributed.env import Threads, rank_environment
from mrl.distributed.errors import WorkerDiedError, WorkerError, WorkerTimeoutError
from mrl.distributed.host import WorkerHost
from mrl.distributed.transport import decode, encode

log = logging.getLogger(__name__)

#: A worker method, passed by reference (`PolicyWorker.train`): the group calls it by name on every rank.
Method = Callable[..., Any]
#: How long `WorkerGroup.shutdown(clean=...)` waits for the ranks' own clean-up before killing them.
CLEAN_SHUTDOWN_S = 30.0
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


@dataclass(frozen=True)
class DataParallelLayout:
    """Which data-parallel rank each global rank belongs to, and which rank of each data-parallel group is its
    leader (the one whose return value represents the group: e.g. the last pipeline stage, TP rank 0).

    `dp_rank[r]` and `is_leader[r]` are indexed by global rank r. Data-parallel ranks are 0..D-1, each with
    exactly one leader.
    """

    dp_rank: tuple[int, ...]
    is_leader: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.dp_rank) != len(self.is_leader):
            raise ValueError("dp_rank and is_leader must have one entry per global rank")
        size = self.dp_size
        if sorted(set(self.dp_rank)) != list(range(size)):
            raise ValueError(f"data-parallel ranks must be 0..{size - 1} with none missing, got {list(self.dp_rank)}")
        for dp in range(size):
            leaders = [r for r, (d, lead) in enumerate(zip(self.dp_rank, self.is_leader)) if d == dp and lead]
            if len(leaders) != 1:
                raise ValueError(f"data-parallel rank {dp} must have exactly one leader, got ranks {leaders}")

    @property
    def dp_size(self) -> int:
        return max(self.dp_rank) + 1 if self.dp_rank else 0

    @property
    def leaders(self) -> list[int]:
        """Global rank of the leader of each data-parallel rank, in data-parallel order."""
        by_dp = {d: r for r, (d, lead) in enumerate(zip(self.dp_rank, self.is_leader)) if lead}
        return [by_dp[dp] for dp in range(self.dp_size)]

    @classmethod
    def pure(cls, world_size: int) -> "DataParallelLayout":
        """Every rank is its own data-parallel group (no model parallelism)."""
        return cls(tuple(range(world_size)), (True,) * world_size)

    @classmethod
    def from_reports(cls, reports: Sequence[tuple[int, bool]]) -> "DataParallelLayout":
        """From (dp_rank, is_leader) reported by each rank in global rank order."""
        return cls(tuple(int(d) for d, _ in reports), tuple(bool(lead) for _, lead in reports))


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
        group: "WorkerGroup",
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


def _shared(value: Any, readers: int) -> Any:
    """An encoded call argument as it is passed to `readers` calls. Several: put in the object store once, each call
    gets the reference (else Ray would store a copy per call). One: the value itself; Ray sends it inside the call
    when small and stores it once when large, without the round trip to the object store that a put costs (~1 ms,
    measured: a no-op actor call takes 0.6 ms, 1.7 ms with its argument put first; Ray 2.60, 2 cores)."""
    return ray.put(value) if readers > 1 else value


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
                _consume_errors([other for other in pending if other != ref])
                info = future._group.info[future._ranks[slot]]
                raise _worker_exception(future._group.name, future._method, info, error) from error
        gone = _vanished(futures, owner, pending)
        if gone is not None:
            _consume_errors(pending)
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


def _consume_errors(refs: Sequence[ray.ObjectRef]) -> None:
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


class WorkerGroup:
    """`world_size` actors of `worker_cls`, rank r on bundle `bundle_indices[r]` of `placement` (default: all
    bundles in order).

    Each actor asks for `resource_fraction` of its bundle's resources: 1.0 gives a group its bundles alone; two
    groups with 0.5 each share the same bundles (colocation). `gpu_fraction` sets the GPU share apart (0: an actor
    that holds no GPU itself, e.g. a vLLM engine whose own Ray workers hold them). `env` adds variables to every rank
    (not for control
    flags: those are arguments). The worker's __init__ gets `init_args`/`init_kwargs`, and MASTER_ADDR/PORT are
    already set then. `omp_num_threads`: each rank's threads, or "auto": its node's cores divided by `busy_per_node`
    processes (default: the group's ranks on that node; mrl/distributed/env.py).

    `wait_before_init` (optional) is called after the actors are up and have imported the worker class's module,
    and before any worker is built: colocated groups on GPUs build theirs only once the engine sleeps
    (mrl/app/runtime.py). `init_started[r]` is the wall time rank r's __init__ began, `init_finished` when the last
    one returned.

    The group does not own the placement (other groups may share it): `shutdown()` kills the actors and removes the
    placement only when `owns_placement=True` was given.
    """

    def __init__(
        self,
        name: str,
        worker_cls: type,
        placement: Placement,
        *,
        init_args: Sequence[Any] = (),
        init_kwargs: Optional[dict[str, Any]] = None,
        bundle_indices: Optional[Sequence[int]] = None,
        resource_fraction: float = 1.0,
        omp_num_threads: Threads = 1,
        busy_per_node: Optional[int] = None,
        env: Optional[dict[str, str]] = None,
        start_timeout_s: float = 120.0,
        owns_placement: bool = False,
        wait_before_init: Optional[Callable[[], None]] = None,
        gpu_fraction: Optional[float] = None,
    ):
        if not 0.0 < resource_fraction <= 1.0:
            raise ValueError(f"worker group '{name}': resource_fraction must be in (0, 1], got {resource_fraction}")
        if gpu_fraction is not None and not 0.0 <= gpu_fraction <= 1.0:
            raise ValueError(f"worker group '{name}': gpu_fraction must be in [0, 1], got {gpu_fraction}")
        self._gpu_fraction = resource_fraction if gpu_fraction is None else gpu_fraction
        indices = list(range(placement.num_bundles)) if bundle_indices is None else list(bundle_indices)
        bad = [index for index in indices if not 0 <= index < placement.num_bundles]
        if bad or len(set(indices)) != len(indices) or not indices:
            raise ValueError(
                f"worker group '{name}': bundle_indices {indices} must be distinct indices into placement "
                f"'{placement.name}' (0..{placement.num_bundles - 1})"
            )
        self.name = name
        self.worker_cls = worker_cls
        self.placement = placement
        self.bundles = [placement.bundles[index] for index in indices]
        self.layout = DataParallelLayout.pure(len(indices))
        self._owns_placement = owns_placement
        self._actors: list[Any] = []
        self.info: list[WorkerInfo] = []
        self.init_started: list[float] = []
        self.init_finished = 0.0
        self._wait_before_init = wait_before_init
        self.deadlines: Optional[Deadlines] = None  # per-call deadlines once set (the runtime sets them); None: none
        self.hung = False  # a call passed its deadline: the ranks may never answer again
        try:
            threads = (omp_num_threads, busy_per_node)
            self._start(init_args, init_kwargs or {}, resource_fraction, threads, env or {}, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        return len(self.bundles)

    # ------------------------------------------------------------------------------------------------- start-up
    def _start(
        self,
        init_args: Sequence[Any],
        init_kwargs: dict[str, Any],
        fraction: float,
        threads: tuple[Threads, Optional[int]],
        extra_env: dict[str, str],
        timeout_s: float,
    ) -> None:
        envs = rank_environment([bundle.node_id for bundle in self.bundles], *threads)
        host_cls = ray.remote(WorkerHost)
        for rank, bundle in enumerate(self.bundles):
            strategy = PlacementGroupSchedulingStrategy(bundle.group, placement_group_bundle_index=bundle.index)
            actor = host_cls.options(
                num_cpus=bundle.resources.get("CPU", 0.0) * fraction,
                num_gpus=bundle.resources.get("GPU", 0.0) * self._gpu_fraction,
                scheduling_strategy=strategy,
                max_restarts=0,
                runtime_env={"env_vars": {**extra_env, **envs[rank]}},
            ).remote()
            self._actors.append(actor)
        # Placeholder infos so a failure while starting can already name the rank.
        self.info = [WorkerInfo(rank, bundle.node_ip, bundle.node_id, -1) for rank, bundle in enumerate(self.bundles)]
        wanted = {
            key: value * (self._gpu_fraction if key == "GPU" else fraction)
            for key, value in self.bundles[0].resources.items()
        }
        try:
            reports = GroupFuture(self, "start", [a.info.remote() for a in self._actors], range(self.world_size))
            reports = reports.result(timeout_s)
        except WorkerTimeoutError as error:
            raise WorkerTimeoutError(
                f"worker group '{self.name}': actors did not start within {timeout_s:g} s. Each asks for {wanted} "
                f"of a bundle of {self.bundles[0].resources}: are other groups already using the rest of these "
                "bundles (resource fractions of colocated groups must sum to <= 1)?",
                group=self.name,
                rank=error.rank,
            ) from None
        self.info = [WorkerInfo(r, rep["node_ip"], rep["node_id"], rep["pid"]) for r, rep in enumerate(reports)]
        port = GroupFuture(self, "free_port", [self._actors[0].free_port.remote()], [0]).result(timeout_s)[0]
        rendezvous = {"MASTER_ADDR": self.info[0].node_ip, "MASTER_PORT": str(port)}
        payload = ray.put(encode((tuple(init_args), init_kwargs)))
        cls_ref = ray.put(self.worker_cls)
        if self._wait_before_init is not None:
            preloads = [actor.preload.remote(cls_ref) for actor in self._actors]  # imports while we wait
            self._wait_before_init()
            GroupFuture(self, "import", preloads, range(self.world_size)).result(timeout_s)
        refs = [actor.start.remote(cls_ref, rendezvous, payload) for actor in self._actors]
        self.init_started = GroupFuture(
            self, f"{self.worker_cls.__name__}.__init__", refs, range(self.world_size)
        ).result()
        self.init_finished = time.time()
        self.master_addr, self.master_port = rendezvous["MASTER_ADDR"], port
        log.info("worker group '%s': %d ranks up, rendezvous %s:%s", self.name, self.world_size, *rendezvous.values())

    # ---------------------------------------------------------------------------------------------- data layout
    def set_layout(self, layout: DataParallelLayout) -> None:
        """Declare which ranks form each data-parallel group (e.g. after the workers built their process groups)."""
        if len(layout.dp_rank) != self.world_size:
            raise ValueError(
                f"worker group '{self.name}': layout covers {len(layout.dp_rank)} ranks, the group has "
                f"{self.world_size}"
            )
        self.layout = layout

    def layout_from_workers(self, method: Method) -> DataParallelLayout:
        """Ask every rank `method()` -> (dp_rank, is_leader) and use the answer as the layout."""
        layout = DataParallelLayout.from_reports(self.run_all(method))
        self.set_layout(layout)
        return layout

    # ------------------------------------------------------------------------------------------------- dispatch
    def _method_name(self, method: Method) -> str:
        """The name every rank calls `method` by. Callers pass the worker class's function itself
        (`run_all(PolicyWorker.export_bucket, ...)`, not a string): a rename fails where the call is written (and
        under mypy), not in a run. A subclass's override of the method runs, as a method call would."""
        name = getattr(method, "__name__", None)
        owner = getattr(method, "__qualname__", "").rpartition(".")[0]
        classes = {cls.__qualname__ for cls in self.worker_cls.__mro__}
        if not callable(method) or name is None or owner not in classes:
            raise TypeError(
                f"worker group '{self.name}': {method!r} is not a method of {self.worker_cls.__name__}; pass the "
                f"worker class's function, e.g. {self.worker_cls.__name__}.<method>"
            )
        if not callable(getattr(self.worker_cls, name, None)):
            raise AttributeError(f"worker group '{self.name}': {self.worker_cls.__name__} has no method '{name}'")
        return name

    def _deadline(self, method: str, work: Optional[Work]) -> Optional[float]:
        return None if self.deadlines is None else self.deadlines.seconds(method, work)

    def _payload(self, args: tuple, kwargs: dict[str, Any], readers: Optional[int] = None) -> Any:
        return _shared(encode((args, kwargs)), self.world_size if readers is None else readers)

    def run_all_async(self, method: Method, /, *args: Any, work: Optional[Work] = None, **kwargs: Any) -> GroupFuture:
        """Every rank runs `method(*args, **kwargs)` with the same (replicated) arguments; the future's result is
        the list of per-rank return values in rank order. `work` (reserved, not passed on): what the call computes
        and moves, for its deadline (`deadlines`)."""
        name = self._method_name(method)
        payload = self._payload(args, kwargs)
        refs = [actor.call.remote(name, payload) for actor in self._actors]
        return GroupFuture(self, name, refs, range(self.world_size), deadline_s=self._deadline(name, work))

    def run_all(self, method: Method, /, *args: Any, work: Optional[Work] = None, **kwargs: Any) -> list[Any]:
        return self.run_all_async(method, *args, work=work, **kwargs).result()

    def run_on_leaders_async(
        self, method: Method, /, *args: Any, work: Optional[Work] = None, **kwargs: Any
    ) -> GroupFuture:
        """Only the leader of each data-parallel group runs the method (replicated arguments); the result is the
        list of leader return values in data-parallel order. The method must not enter collectives that need the
        other ranks: they are not called."""
        name = self._method_name(method)
        leaders = self.layout.leaders
        payload = self._payload(args, kwargs, readers=len(leaders))
        refs = [self._actors[rank].call.remote(name, payload) for rank in leaders]
        return GroupFuture(self, name, refs, leaders, deadline_s=self._deadline(name, work))

    def run_on_leaders(self, method: Method, /, *args: Any, work: Optional[Work] = None, **kwargs: Any) -> list[Any]:
        return self.run_on_leaders_async(method, *args, work=work, **kwargs).result()

    def shard_and_run_async(
        self,
        method: Method,
        batch: Any,
        /,
        *args: Any,
        allow_uneven: bool = False,
        work: Optional[Work] = None,
        **kwargs: Any,
    ) -> GroupFuture:
        """Split `batch` along axis 0 over the data-parallel ranks (contract in mrl.distributed.batch), call
        `method(shard, *args, **kwargs)` on every rank -- all ranks of a data-parallel group get the same shard;
        `args`/`kwargs` are replicated -- and merge the leaders' results in data-parallel order, i.e. batch order:
        row i of a merged array output belongs to row i of the input batch. `allow_uneven` and `work` are reserved
        by this method (not passed to the worker)."""
        name = self._method_name(method)
        shards = split_batch(batch, self.layout.dp_size, allow_uneven)
        readers = Counter(self.layout.dp_rank[rank] for rank in range(self.world_size))  # ranks per shard
        shard_refs = [_shared(encode(shard), readers[index]) for index, shard in enumerate(shards)]
        payload = self._payload(args, kwargs)
        refs = [
            actor.call_with_shard.remote(name, shard_refs[self.layout.dp_rank[rank]], payload)
            for rank, actor in enumerate(self._actors)
        ]
        leaders = self.layout.leaders

        def gather_leaders(values: list[Any]) -> Any:  # values in global rank order; keep one per DP group
            return merge_shards([values[rank] for rank in leaders])

        return GroupFuture(
            self, name, refs, range(self.world_size), gather_leaders, deadline_s=self._deadline(name, work)
        )

    def shard_and_run(
        self,
        method: Method,
        batch: Any,
        /,
        *args: Any,
        allow_uneven: bool = False,
        work: Optional[Work] = None,
        **kwargs: Any,
    ) -> Any:
        return self.shard_and_run_async(method, batch, *args, allow_uneven=allow_uneven, work=work, **kwargs).result()

    # ------------------------------------------------------------------------------------------------- shutdown
    def _ask_clean_up(self, method: Method, timeout_s: float) -> None:
        """Run `method` on every rank for at most `timeout_s`, raising nothing. A bare wait, not `result()`: a late
        rank's timeout error would first fetch its stack (`stacks.stacks_of`, a Ray task per rank, ~10 s to start
        a worker process on a loaded 2-core machine), which the shutdown does not need."""
        try:
            refs = self.run_all_async(method)._refs
            done, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            _consume_errors(done)
        except Exception as error:  # noqa: BLE001 -- dead, stuck or Ray gone: the kill that follows still applies
            log.debug("worker group '%s': '%s' before shutdown: %s", self.name, method, error)
            return
        if late:
            log.debug(
                "worker group '%s': '%s' before shutdown: %d rank(s) still busy after %g s",
                self.name,
                method,
                len(late),
                timeout_s,
            )

    def shutdown(self, clean: Optional[Method] = None, timeout_s: float = CLEAN_SHUTDOWN_S) -> None:
        """Kill every actor (also ones blocked in a collective) and, if owned, remove the placement. With `clean`,
        every rank first runs that method (e.g. leaving its process groups) for at most `timeout_s`: a rank still
        blocked in a collective whose peer failed mid-step would otherwise hold the shutdown until the collective's
        own timeout (gloo: 10 minutes). Its failure or lateness is not raised (the run's own error, if any, is what
        the user needs): the actors are killed anyway. A group that hung (a call passed its deadline) is killed
        without asking."""
        if clean is not None and self._actors and not self.hung:
            self._ask_clean_up(clean, timeout_s)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as error:  # noqa: BLE001 already dead or Ray is gone: nothing to kill
                log.debug("worker group '%s': kill: %s", self.name, error)
        self._actors = []
        if self._owns_placement:
            from ray.util.placement_group import remove_placement_group

            for group in self.placement.groups:
                try:
                    remove_placement_group(group)
                except Exception as error:  # noqa: BLE001 already removed, or Ray is gone
                    log.debug("worker group '%s': remove placement: %s", self.name, error)
