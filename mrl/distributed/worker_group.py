"""A worker group: one Ray actor per rank, built from a plain Python worker class, driven by one controller.

The controller never handles ranks: it calls `run_all` (every rank, same arguments), `run_on_leaders` (one rank per
data-parallel group) or `shard_and_run` (the batch split over data-parallel ranks, results gathered back in batch
order), or their `_async` variants, which return a `GroupFuture` so that several groups can work at once.

Rank r runs on bundle r of its placement with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, OMP_NUM_THREADS set
at process start, and MASTER_ADDR/MASTER_PORT (rank 0's node and a port found free there, once per group) set
before the worker class is built, so `torch.distributed.init_process_group(init_method="env://")` works inside
its __init__ or any later method. On GPUs, Ray sets CUDA_VISIBLE_DEVICES to the bundle's device.

Failure: every wait watches all ranks at once; the first rank that raises or dies ends the call (group_calls.py).
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
from mrl.distributed.errors import WorkerTimeoutError
from mrl.distributed.group_calls import GroupFuture, WorkerInfo, consume_errors
from mrl.distributed.host import WorkerHost
from mrl.distributed.transport import encode

log = logging.getLogger(__name__)

#: A worker method, passed by reference (`PolicyWorker.train`): the group calls it by name on every rank.
Method = Callable[..., Any]
#: How long `WorkerGroup.shutdown(clean=...)` waits for the ranks' own clean-up before killing them.
CLEAN_SHUTDOWN_S = 30.0


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


def _shared(value: Any, readers: int) -> Any:
    """An encoded call argument as it is passed to `readers` calls. Several: put in the object store once, each call
    gets the reference (else Ray would store a copy per call). One: the value itself; Ray sends it inside the call
    when small and stores it once when large, without the round trip to the object store that a put costs (~1 ms,
    measured: a no-op actor call takes 0.6 ms, 1.7 ms with its argument put first; Ray 2.60, 2 cores)."""
    return ray.put(value) if readers > 1 else value


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
            consume_errors(done)
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
