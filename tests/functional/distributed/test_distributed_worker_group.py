"""Worker groups on a real local Ray instance (one per module): environment, gloo rendezvous, sharding, failures,
colocation. Two ranks per group, each asking for half a CPU bundle, so everything fits on 2 cores."""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import ray
import torch

from mrl.checkpoint.manager import write_atomic
from mrl.distributed import (
    ClusterResourceError,
    DataParallelLayout,
    Deadlines,
    Work,
    RayCluster,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
    wait_all,
)
from mrl.distributed.env import node_cores
from mrl.testing.distributed import still_running

# Worker classes below are defined in this test module, which worker processes cannot import: ship them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


class Worker:
    """A plain class, as callers write them."""

    def __init__(self, seed: int = 0):
        self.rank = int(os.environ["RANK"])
        self.model = _linear(seed)

    def env(self) -> dict:
        started_with = dict(line.split("=", 1) for line in open("/proc/self/environ").read().split("\0") if "=" in line)
        return ({key: os.environ.get(key) for key in ENV_KEYS} | {"threads": torch.get_num_threads()}
                | {"malloc_at_start": started_with.get("MALLOC_MMAP_THRESHOLD_"), "niceness": os.nice(0)})

    def init_gloo(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))

    def all_reduce_rank(self) -> float:
        import torch.distributed as dist

        value = torch.tensor([self.rank + 1.0])
        dist.all_reduce(value)
        return float(value)

    def forward(self, batch: dict, scale: float) -> dict:
        with torch.no_grad():
            y = self.model(batch["x"]) * scale  # [b, 3]
        return {"y": y, "rank": [self.rank] * len(y), "ids": batch["ids"]}

    def dp_info(self) -> tuple:
        return 0, self.rank == 1  # one data-parallel group whose leader is rank 1

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad input seen by rank {self.rank}")
        return self.rank

    def exit_during_all_reduce(self, victim: int) -> float:
        if self.rank == victim:
            time.sleep(0.5)  # let the other rank block in the collective first
            os._exit(7)
        return self.all_reduce_rank()

    def sleep(self, seconds: float, started: Optional[str] = None) -> int:
        if started:  # a marker per rank: the call has begun (not still queued behind Ray's dispatch)
            Path(f"{started}.{self.rank}").touch()
        time.sleep(seconds)
        return self.rank

    def fork_then_sleep(self, child_pid_file: str, seconds: float) -> int:
        """Fork a child that outlives the call, as megatron-core's checkpoint writers do: it inherits this process's
        connection to Ray (so Ray cannot see this process die while the child lives)."""
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
        # a file each (every rank forks), whole when it appears: the test kills this rank on sight
        write_atomic(Path(f"{child_pid_file}.{self.rank}"), lambda f: f.write(str(child).encode()))
        time.sleep(seconds)
        return self.rank

    def all_reduce_after_a_stop(self, stopped: int) -> float:
        """The stopped rank is stopped by the test; the other waits in the collective for it."""
        if self.rank == stopped:
            time.sleep(600)
        return _waiting_in_the_collective(self)


def _waiting_in_the_collective(worker: "Worker") -> float:
    return worker.all_reduce_rank()


@pytest.fixture(scope="module")
def cluster():
    cluster = RayCluster(num_cpus=4, log_to_driver=False)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def shared_placement(cluster):
    placement = cluster.create_placement("shared", bundles_per_node=2, cpus_per_bundle=1)
    yield placement
    cluster.remove_placement(placement)


@pytest.fixture(scope="module")
def group(shared_placement):
    """One group for the tests that leave it usable (starting actors that import torch costs seconds)."""
    group = WorkerGroup("policy", Worker, shared_placement, resource_fraction=0.5, omp_num_threads=2)
    yield group
    group.shutdown()


@pytest.fixture
def placement(cluster):
    placement = cluster.create_placement("test", bundles_per_node=2, cpus_per_bundle=1)
    yield placement
    cluster.remove_placement(placement)


@pytest.fixture
def fresh_group(placement):
    """A group for tests that kill a worker."""
    group = WorkerGroup("policy", Worker, placement, resource_fraction=0.5)
    yield group
    group.shutdown()


def test_run_all_sets_rank_environment(group):
    envs = group.run_all(Worker.env)
    assert [env["RANK"] for env in envs] == ["0", "1"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1"]  # both bundles on this one node
    for env in envs:
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == group.info[0].node_ip and env["MASTER_PORT"] == str(group.master_port)
        assert env["OMP_NUM_THREADS"] == "2" and env["threads"] == 2  # set before torch started in the worker
        assert env["malloc_at_start"] == str(32 * 1024 * 1024)  # in the process's first environment: glibc read it
        assert env["niceness"] == os.nice(0)  # the controller's priority, not Ray's default nice 15 for workers
    assert len({info.pid for info in group.info}) == 2 and os.getpid() not in {info.pid for info in group.info}


def test_auto_threads_give_a_group_alone_on_a_node_its_cores(placement):
    """Threads "auto" (cluster.omp_num_threads' default): one rank alone on the node takes all its cores; two ranks
    of a group, or a rank told that another process computes beside it, take half each."""
    cores = node_cores()
    expected = {1: cores, 2: max(1, cores // 2)}
    for indices, busy in (([0], None), ([0, 1], None), ([0], 2)):
        group = WorkerGroup("auto", Worker, placement, bundle_indices=indices, resource_fraction=0.5,
                            omp_num_threads="auto", busy_per_node=busy)
        try:
            for env in group.run_all(Worker.env):
                shared_by = busy or len(indices)
                assert env["threads"] == expected[shared_by] and env["OMP_NUM_THREADS"] == str(expected[shared_by])
        finally:
            group.shutdown()


def test_gloo_all_reduce_with_group_environment(group):
    group.run_all(Worker.init_gloo)
    assert group.run_all(Worker.all_reduce_rank) == [3.0, 3.0]  # 1 + 2


def test_shard_and_run_matches_single_process_in_batch_order(group):
    torch.manual_seed(1)
    batch = {"x": torch.randn(5, 4), "ids": np.arange(5)}
    expected = _linear(0)(batch["x"]).detach() * 2.0

    with pytest.raises(ValueError, match="5 rows does not split evenly over 2"):
        group.shard_and_run(Worker.forward, batch, 2.0)
    out = group.shard_and_run(Worker.forward, batch, 2.0, allow_uneven=True)
    torch.testing.assert_close(out["y"], expected, rtol=0, atol=1e-6)
    assert out["rank"] == [0, 0, 0, 1, 1] and out["ids"].tolist() == [0, 1, 2, 3, 4]
    assert group.run_on_leaders(Worker.fail_on, -1) == [0, 1]


def test_data_parallel_leaders_from_workers(group):
    layout = group.layout_from_workers(Worker.dp_info)
    try:
        assert layout == DataParallelLayout((0, 0), (False, True))
        batch = {"x": torch.randn(3, 4), "ids": np.arange(3)}
        out = group.shard_and_run(Worker.forward, batch, 1.0)  # both ranks get the whole batch, rank 1 answers
        assert out["rank"] == [1, 1, 1] and out["ids"].tolist() == [0, 1, 2]
        assert group.run_on_leaders(Worker.fail_on, -1) == [1]
    finally:
        group.set_layout(DataParallelLayout.pure(2))


def test_exception_in_worker_names_rank_and_keeps_cause(group):
    with pytest.raises(WorkerError, match=r"'policy' rank 1 \(node .*, pid \d+\) raised ValueError") as caught:
        group.run_all(Worker.fail_on, 1)
    assert caught.value.rank == 1 and not isinstance(caught.value, WorkerDiedError)
    assert isinstance(caught.value.cause, ValueError) and "seen by rank 1" in str(caught.value.cause)
    assert group.run_all(Worker.fail_on, -1) == [0, 1]  # a raised exception leaves the workers usable


def test_worker_exit_inside_collective_raises_died_error_quickly(fresh_group):
    group = fresh_group
    group.run_all(Worker.init_gloo)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=f"'policy' rank 1 \\(node .*, pid {group.info[1].pid}\\) died"):
        group.run_all(Worker.exit_during_all_reduce, 1)
    assert time.monotonic() - start < 10


def test_killed_worker_process_raises_died_error(fresh_group):
    group = fresh_group
    future = group.run_all_async(Worker.sleep, 60)
    time.sleep(0.5)
    os.kill(group.info[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 0") as caught:
        future.result(timeout_s=30)
    assert caught.value.rank == 0 and time.monotonic() - start < 10
    with pytest.raises(WorkerDiedError, match="rank 0"):  # a later call fails at once too
        group.run_all(Worker.fail_on, -1)


def test_a_killed_worker_whose_forked_child_lives_on_is_found_dead_and_the_child_killed(fresh_group, tmp_path):
    """Before, the call waited for its deadline: the child held the worker's connection to Ray open (a policy worker
    killed while its checkpoint writers ran, in the 50-fault campaign)."""
    import psutil

    group = fresh_group
    future = group.run_all_async(Worker.fork_then_sleep, str(tmp_path / "child"), 60)
    child_pid = tmp_path / "child.0"  # rank 0's child (rank 0 is killed); rank 1's also forks, and lives on
    deadline = time.monotonic() + 60
    while not child_pid.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = group.info[0].pid
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=f"rank 0 \\(node .*, pid {worker}\\) died while running 'fork_then_sleep'"):
        future.result(timeout_s=60)
    assert time.monotonic() - start < 10
    child = int(child_pid.read_text())
    for _ in range(100):  # the orphan was killed with its dead parent's process group
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the dead worker's child {child} still runs")


def test_a_call_past_its_deadline_names_the_late_ranks_with_their_stacks(fresh_group):
    """A hang: rank 0 is stopped (SIGSTOP) before it joins an all-reduce, rank 1 waits in the all-reduce for it.
    The deadline ends the call with rank 1's stack (in the collective) and rank 0's state (it cannot run a handler)."""
    group = fresh_group
    group.run_all(Worker.init_gloo)
    group.deadlines = Deadlines(floor_s=3.0, tokens_per_s=100.0, overrides={"sleep": 60.0})
    assert group.deadlines.seconds("all_reduce_after_a_stop", Work(tokens=200)) == 5.0  # the floor + the work
    future = group.run_all_async(Worker.all_reduce_after_a_stop, 0, work=Work(tokens=200))
    time.sleep(0.5)
    os.kill(group.info[0].pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerTimeoutError) as caught:
            future.result()
    finally:
        os.kill(group.info[0].pid, signal.SIGCONT)
    text = str(caught.value)
    assert "'all_reduce_after_a_stop' did not finish within 5 s on ranks [0, 1]" in text, text
    assert f"stack of rank 0 (node {group.info[0].node_ip}, pid {group.info[0].pid})" in text
    assert "no stack: the process is stopped" in text, text
    rank1 = text[text.index("stack of rank 1"):]
    assert "_waiting_in_the_collective" in rank1 and "all_reduce" in rank1, rank1
    assert caught.value.rank == 0 and caught.value.method == "all_reduce_after_a_stop"
    assert time.monotonic() - start < 5.0 + 25  # the deadline, then the stacks (a Ray task per rank)


def test_a_slow_call_within_its_deadline_and_an_explicit_timeout(fresh_group, tmp_path):
    group = fresh_group
    group.deadlines = Deadlines(floor_s=0.5, overrides={"sleep": 30.0})
    assert group.run_all(Worker.sleep, 1.0) == [0, 1]  # past the floor, within its override
    future = group.run_all_async(Worker.sleep, 20.0, started=str(tmp_path / "started"))
    # The stacks must show the ranks inside the call: wait until both have begun it (on a loaded machine Ray may
    # still be dispatching it half a second after the submit, and the stack would show the idle worker loop).
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"started.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(WorkerTimeoutError, match=r"'sleep' did not finish within 0\.5 s") as caught:
        future.result(timeout_s=0.5)  # the caller's own timeout wins
    assert "stack of rank 0" in str(caught.value) and "in sleep" in str(caught.value)


def test_shutdown_asks_for_clean_up_but_does_not_wait_for_a_stuck_rank(fresh_group):
    """Ranks still busy (as one blocked in a collective whose peer raised) get `timeout_s` for the clean-up call,
    then every actor is killed."""
    group = fresh_group
    pids = [info.pid for info in group.info]
    group.run_all_async(Worker.sleep, 600)  # ten minutes: the shutdown must not wait for it
    time.sleep(0.5)
    start = time.monotonic()
    group.shutdown(clean=Worker.env, timeout_s=2)
    assert time.monotonic() - start < 10
    assert still_running(pids) == []


def test_colocated_groups_share_bundles_and_overlap(placement):
    policy = WorkerGroup("policy", Worker, placement, resource_fraction=0.5)
    rollout = WorkerGroup("rollout", Worker, placement, resource_fraction=0.5)
    try:
        assert [b.index for b in policy.bundles] == [b.index for b in rollout.bundles] == [0, 1]
        assert policy.master_port != rollout.master_port
        wait_all([policy.run_all_async(Worker.init_gloo), rollout.run_all_async(Worker.init_gloo)])
        sums = wait_all([policy.run_all_async(Worker.all_reduce_rank), rollout.run_all_async(Worker.all_reduce_rank)])
        assert sums == [[3.0, 3.0], [3.0, 3.0]]  # two independent process groups on the same bundles
        with pytest.raises(WorkerTimeoutError, match="'third': actors did not start.*must sum to <= 1"):
            WorkerGroup("third", Worker, placement, resource_fraction=0.5, start_timeout_s=2)
    finally:
        policy.shutdown()
        rollout.shutdown()


def test_disjoint_groups_on_separate_bundles(placement):
    left = WorkerGroup("left", Worker, placement, bundle_indices=[0])
    right = WorkerGroup("right", Worker, placement, bundle_indices=[1])
    try:
        assert left.run_all(Worker.env)[0]["RANK"] == right.run_all(Worker.env)[0]["RANK"] == "0"
    finally:
        left.shutdown()
        right.shutdown()


def test_placement_larger_than_cluster_names_available_resources(cluster):
    with pytest.raises(ClusterResourceError, match=r"\{CPU: 8\}.*has \{CPU: 4\} in total"):
        cluster.create_placement("huge", bundles_per_node=8)
    with pytest.raises(ClusterResourceError, match="GPU"):
        cluster.create_placement("gpus", bundles_per_node=1, gpus_per_bundle=1)


def test_one_group_placement_holds_every_bundle_in_rank_order(cluster):
    """`one_group=True` (a vLLM engine across nodes): one placement group of all the nodes' bundles, in rank order
    (a local Ray is one node; the node-by-node order is `nodes_in_order`'s, tested with bundles on several nodes in
    tests/unit/distributed)."""
    placement = cluster.create_placement("united", bundles_per_node=2, cpus_per_bundle=1, one_group=True)
    try:
        assert len(placement.groups) == 1 and placement.num_bundles == 2
        assert [b.index for b in placement.bundles] == [0, 1]
        assert {b.group.id for b in placement.bundles} == {placement.groups[0].id}
        group = WorkerGroup("united", Worker, placement)
        try:
            assert [env["RANK"] for env in group.run_all(Worker.env)] == ["0", "1"]
        finally:
            group.shutdown()
    finally:
        cluster.remove_placement(placement)


class FailingInit:
    def __init__(self):
        if os.environ["RANK"] == "1":
            raise RuntimeError("checkpoint not found")


def test_failing_worker_init_names_rank_and_frees_the_bundles(placement):
    with pytest.raises(WorkerError, match=r"'broken' rank 1 .* raised RuntimeError in 'FailingInit.__init__'"):
        WorkerGroup("broken", FailingInit, placement)
    group = WorkerGroup("after", Worker, placement)  # the failed group's actors were killed: full bundles free
    group.shutdown()
