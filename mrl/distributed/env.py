"""Pure helpers for the per-rank environment of worker processes: rank variables (and the free port of rank 0).

These variables are what `torch.distributed.init_process_group(init_method="env://")` and Megatron read:
MASTER_ADDR/MASTER_PORT (rank 0's rendezvous), RANK/WORLD_SIZE, LOCAL_RANK/LOCAL_WORLD_SIZE (position among the
ranks of the same node) and OMP_NUM_THREADS (without it each rank spawns one thread per core and a tiny step on a
2-core machine takes 0.6 s instead of 14 ms, measured). Every rank also gets `ALLOCATOR_ENVIRONMENT`.

Across nodes, gloo must not bind the address its host name resolves to: Debian's /etc/hosts maps the host name to
127.0.1.1 (or 127.0.0.1), and the other nodes then "connect" to their own loopback (measured on a two-node Slurm:
"connectFullMesh failed ... remote=[127.0.0.1]"). So when the ranks span several nodes, each rank binds gloo to the
network interface that holds its Ray node's IP (`gloo_interface`), unless GLOO_SOCKET_IFNAME is set already.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mrl.parallel.groups import free_port as find_free_port  # noqa: F401  (the one implementation)

#: Set in the rank environment when the ranks span several nodes (see the module docstring).
BIND_GLOO_TO_NODE_IP = "MRL_BIND_GLOO_TO_NODE_IP"

#: glibc malloc settings of every worker process (read once, when the process starts). By default glibc serves
#: blocks over a moving threshold (128 KiB at first) with fresh mmaps and returns freed heap tops to the kernel, so a
#: train step whose activations change size every step faults its memory in again each time: measured on the GRPO
#: benchmark's CPU policy (2 threads), ~5,500 page faults and 30 ms of kernel time per 97 ms step. Blocks up to
#: 32 MiB (glibc's largest threshold) from the heap, and up to 256 MiB of free heap kept: ~2,000 faults, 5 ms,
#: 80 ms per step. The cost is resident memory: freed blocks stay with the process for reuse.
ALLOCATOR_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def local_ranks(node_of_rank: Sequence[str]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) per global rank: the rank's index among the ranks on the same node, in
    global rank order, and how many ranks that node holds. `node_of_rank[r]` is any node key (IP or node id)."""
    counts: dict[str, int] = {}
    positions: list[int] = []
    for node in node_of_rank:
        positions.append(counts.get(node, 0))
        counts[node] = positions[-1] + 1
    return [(position, counts[node]) for position, node in zip(positions, node_of_rank)]


def rank_environment(node_of_rank: Sequence[str], omp_num_threads: int) -> list[dict[str, str]]:
    """Per-rank environment without the rendezvous address (added once rank 0's port is known).

    On GPUs, Ray sets CUDA_VISIBLE_DEVICES to the GPU of the actor's bundle; a worker then picks its device by the
    device rule (mrl/parallel/devices.py: its one visible GPU is device 0), not by LOCAL_RANK alone.
    """
    if omp_num_threads < 1:
        raise ValueError(f"omp_num_threads must be >= 1, got {omp_num_threads}")
    world_size = len(node_of_rank)
    envs = []
    for rank, (local_rank, local_world_size) in enumerate(local_ranks(node_of_rank)):
        envs.append(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(local_world_size),
                "OMP_NUM_THREADS": str(omp_num_threads),
                **ALLOCATOR_ENVIRONMENT,
                **({BIND_GLOO_TO_NODE_IP: "1"} if len(set(node_of_rank)) > 1 else {}),
            }
        )
    return envs


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
