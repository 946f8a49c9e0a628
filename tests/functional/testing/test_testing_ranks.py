"""`mrl.testing.distributed.run_on_ranks`, the runner of every multi-process test: results come back in rank order,
and a rank leaves nothing running behind it."""

from __future__ import annotations

import os
import time

from mrl.testing.distributed import run_on_ranks


# ---- rank side ----
_queues = []


def start_a_manager() -> tuple[int, int]:
    """Start a multiprocessing manager server as Megatron's asynchronous checkpointing does: a spawned process
    whose queue a module global keeps alive."""
    import multiprocessing

    manager = multiprocessing.get_context("spawn").Manager()
    _queues.append(manager.Queue())
    return int(os.environ["RANK"]), manager._process.pid


# ---- tests ----
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return status != "Z"  # a zombie has exited; its parent (init) reaps it


def test_a_rank_stops_its_child_processes_before_it_exits():
    results = run_on_ranks(start_a_manager, world_size=2)
    assert [rank for rank, _ in results] == [0, 1]
    servers = [pid for _, pid in results]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in servers), servers
