"""A worker Ray reports dead may still be exiting: its orphaned children are killed once it has (the kernel closes a
process's files, which is how Ray can learn of the death, before it ends the process). Real processes, no Ray: the
worker stands in as a process that leads its own group (as Ray starts each worker) and forks a long-lived child."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

from mrl.distributed.errors import WorkerDiedError
from mrl.distributed import group_calls
from mrl.distributed.group_calls import WorkerInfo, _worker_exception

pytestmark = pytest.mark.unit

WORKER = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
open(sys.argv[1], "w").write(str(child))
time.sleep(float(sys.argv[2]))  # still exiting when Ray's report arrives
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_worker_reported_dead_before_it_exits_has_its_orphans_killed_once_it_has(tmp_path, monkeypatch):
    monkeypatch.setattr(group_calls, "_local_node_id", lambda: "this-node")  # asking Ray would start a cluster
    child_file = tmp_path / "child"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(child_file), "0.5"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not child_file.exists() or not child_file.read_text():
            assert time.monotonic() < deadline, "the stand-in worker did not fork"
            time.sleep(0.02)
        child = int(Path(child_file).read_text())
        info = WorkerInfo(rank=0, node_ip="127.0.0.1", node_id="this-node", pid=worker.pid)
        error = _worker_exception("policy", "save", info, ray.exceptions.RayActorError())
        assert isinstance(error, WorkerDiedError)
        assert worker.poll() is not None or _gone(worker.pid)  # it waited for the worker's exit ...
        for _ in range(100):  # ... then killed its process group, the orphan with it
            if _gone(child):
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"the dead worker's child {child} still runs")
    finally:
        worker.kill()
        worker.wait()
