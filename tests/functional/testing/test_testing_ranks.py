"""`mrl.testing.distributed.run_on_ranks`, the runner of every multi-process test: results come back in rank order,
and a rank leaves nothing running behind it."""

from __future__ import annotations

import os

from mrl.testing.distributed import run_on_ranks, still_running


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
def test_a_rank_stops_its_child_processes_before_it_exits():
    results = run_on_ranks(start_a_manager, world_size=2)
    assert [rank for rank, _ in results] == [0, 1]
    servers = [pid for _, pid in results]
    assert still_running(servers) == []
