"""Pure helpers for the per-rank environment of worker processes: rank variables (and the free port of rank 0).

These variables are what `torch.distributed.init_process_group(init_method="env://")` and Megatron read:
MASTER_ADDR/MASTER_PORT (rank 0's rendezvous), RANK/WORLD_SIZE, LOCAL_RANK/LOCAL_WORLD_SIZE (position among the
ranks of the same node) and OMP_NUM_THREADS (without it each rank spawns one thread per core and a tiny step on a
2-core machine takes 0.6 s instead of 14 ms, measured). Every rank also gets `ALLOCATOR_ENVIRONMENT`.

Threads ("auto", `cluster.omp_num_threads`'s default): the node's cores (`node_cores`: the CPU affinity, capped by a
cgroup CPU quota) divided among the worker processes that compute on that node at the same time. The controller
cannot count another node's cores, so it sends the divisor (`CORES_SHARED_BY`) and each worker divides its own node's
cores when it starts (`take_thread_share`, before the worker class is built).

Across nodes, gloo must not bind the address its host name resolves to: Debian's /etc/hosts maps the host name to
127.0.1.1 (or 127.0.0.1), and the other nodes then "connect" to their own loopback (measured on a two-node Slurm:
"connectFullMesh failed ... remote=[127.0.0.1]"). So when the ranks span several nodes, each rank binds gloo to the
network interface that holds its Ray node's IP (`gloo_interface`), unless GLOO_SOCKET_IFNAME is set already.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Mapping, Optional, Sequence, Union

from mrl.parallel.ports import free_port as find_free_port  # noqa: F401  (the one implementation)

if TYPE_CHECKING:
    from mrl.config.schema import MrlConfig

#: Set in the rank environment when the ranks span several nodes (see the module docstring).
BIND_GLOO_TO_NODE_IP = "MRL_BIND_GLOO_TO_NODE_IP"

#: glibc malloc settings of every worker process (read once, when the process starts). By default glibc serves
#: blocks over a moving threshold (128 KiB at first) with fresh mmaps and returns freed heap tops to the kernel, so a
#: train step whose activations change size every step faults its memory in again each time: measured on the GRPO
#: benchmark's CPU policy (2 threads), ~5,500 page faults and 30 ms of kernel time per 97 ms step. Blocks up to
#: 32 MiB (glibc's largest threshold) from the heap, and up to 256 MiB of free heap kept: ~2,000 faults, 5 ms,
#: 80 ms per step. The cost is resident memory: freed blocks stay with the process for reuse.
ALLOCATOR_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


#: Set instead of OMP_NUM_THREADS when the threads are "auto": how many processes on the node share its cores.
CORES_SHARED_BY = "MRL_CORES_SHARED_BY"

Threads = Union[int, Literal["auto"]]


def local_ranks(node_of_rank: Sequence[str]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) per global rank: the rank's index among the ranks on the same node, in
    global rank order, and how many ranks that node holds. `node_of_rank[r]` is any node key (IP or node id)."""
    counts: dict[str, int] = {}
    positions: list[int] = []
    for node in node_of_rank:
        positions.append(counts.get(node, 0))
        counts[node] = positions[-1] + 1
    return [(position, counts[node]) for position, node in zip(positions, node_of_rank)]


def rank_environment(
    node_of_rank: Sequence[str], omp_num_threads: Threads, busy_per_node: Optional[int] = None
) -> list[dict[str, str]]:
    """Per-rank environment without the rendezvous address (added once rank 0's port is known).

    `omp_num_threads`: threads per rank, or "auto": the node's cores divided by `busy_per_node` (the processes that
    compute on the node at the same time), by default the group's own ranks on the node (LOCAL_WORLD_SIZE).

    On GPUs, Ray sets CUDA_VISIBLE_DEVICES to the GPU of the actor's bundle; a worker then picks its device by the
    device rule (mrl/parallel/devices.py: its one visible GPU is device 0), not by LOCAL_RANK alone.
    """
    if omp_num_threads != "auto" and (not isinstance(omp_num_threads, int) or omp_num_threads < 1):
        raise ValueError(f"omp_num_threads must be an integer >= 1 or 'auto', got {omp_num_threads!r}")
    if busy_per_node is not None and busy_per_node < 1:
        raise ValueError(f"busy_per_node must be >= 1, got {busy_per_node}")
    world_size = len(node_of_rank)
    envs = []
    for rank, (local_rank, local_world_size) in enumerate(local_ranks(node_of_rank)):
        threads = (
            {CORES_SHARED_BY: str(busy_per_node or local_world_size)}
            if omp_num_threads == "auto"
            else {"OMP_NUM_THREADS": str(omp_num_threads)}
        )
        envs.append(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(local_world_size),
                **threads,
                **ALLOCATOR_ENVIRONMENT,
                **({BIND_GLOO_TO_NODE_IP: "1"} if len(set(node_of_rank)) > 1 else {}),
            }
        )
    return envs


def worker_threads(cfg: "MrlConfig", launcher: Mapping[str, str] = os.environ) -> tuple[Threads, Optional[int]]:
    """(omp_num_threads, busy_per_node) for every worker group of a run (`rank_environment`), from
    cluster.omp_num_threads: a number is used as it is; "auto" takes OMP_NUM_THREADS of the launching environment
    when it is set, else shares each node's cores among its ranks of one group when the phases take turns, among all
    of the node's workers (cluster.devices_per_node) when they overlap (asynchronous GRPO)."""
    setting = cfg.cluster.omp_num_threads
    if setting != "auto":
        return setting, None
    exported = launcher.get("OMP_NUM_THREADS", "").strip()
    if exported:
        if not exported.isdigit() or int(exported) < 1:
            raise ValueError(
                f"OMP_NUM_THREADS={exported!r} in the environment that started mrl is not a whole number "
                ">= 1: unset it (cluster.omp_num_threads=auto then shares the cores) or set it right"
            )
        return int(exported), None
    return "auto", cfg.cluster.devices_per_node if cfg.grpo.max_off_policy_steps else None


def node_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a container given 4 CPUs of a
    64-core host sees all 64 in its affinity; quota / period is its share, rounded up)."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup_root)
    return min(cores, max(1, math.ceil(quota))) if quota is not None else cores


def _cgroup_quota(root: Path) -> Optional[float]:
    """CPUs of the cgroup quota (v2 cpu.max "quota period", v1 cfs_quota_us / cfs_period_us), None when unlimited."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()[:2]
        else:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1"):
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def thread_share(cores: int, shared_by: int) -> int:
    """Threads of one of `shared_by` processes computing at once on `cores` cores: an equal share, at least one."""
    return max(1, cores // max(1, shared_by))


def take_thread_share() -> Optional[int]:
    """In a worker process whose threads are "auto" (`CORES_SHARED_BY` set): its share of this node's cores, set as
    OMP_NUM_THREADS (for the processes it starts) and as torch's thread count. Returns the threads, None if the
    group gave a fixed number."""
    shared_by = os.environ.get(CORES_SHARED_BY)
    if not shared_by:
        return None
    import torch

    threads = thread_share(node_cores(), int(shared_by))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


def gloo_interface(node_ip: str, addresses: Optional[dict] = None) -> Optional[str]:
    """The network interface holding `node_ip` (`addresses`: psutil.net_if_addrs()), None when none does."""
    import socket

    if addresses is None:
        import psutil

        addresses = psutil.net_if_addrs()
    for name, entries in addresses.items():
        if any(entry.family == socket.AF_INET and entry.address == node_ip for entry in entries):
            return name
    return None
