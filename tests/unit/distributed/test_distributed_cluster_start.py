"""The workaround for Ray 2.60's fixed 30 s node registration (mrl/distributed/cluster.py, `start_local_ray`): a
start that fails with Ray's own message is tried again after the processes it left are killed; any other failure is
raised at once. `ray.init` is replaced by a stand-in that fails as Ray's `Node.__init__` does (the same bare
Exception and text, ray/_private/node.py) after starting a process, as Ray's GCS server would be left running."""

from __future__ import annotations

import subprocess

import psutil
import pytest

from mrl.distributed import cluster
from mrl.distributed.cluster import LOCAL_START_TRIES, NODE_START_TIMEOUT, start_local_ray

RAY_MESSAGE = (f"{NODE_START_TIMEOUT}. This could happen because some of the raylet failed to startup or the GCS has "
               "become overloaded.")


class SlowNode:
    """ray.init that times out `failures` times, each leaving a child process behind, then starts."""

    def __init__(self, failures: int, error: str = RAY_MESSAGE) -> None:
        self.failures, self.error, self.calls, self.left = failures, error, [], []

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            self.left.append(subprocess.Popen(["sleep", "300"]))
            raise Exception(self.error)  # noqa: TRY002 -- what Ray raises


def test_a_node_that_did_not_register_is_started_again_and_its_leftovers_killed(monkeypatch):
    init = SlowNode(failures=1)
    monkeypatch.setattr(cluster.ray, "init", init)
    start_local_ray(address="local", num_cpus=2)
    assert init.calls == [{"address": "local", "num_cpus": 2}] * 2
    init.left[0].wait(timeout=10)
    assert not psutil.pid_exists(init.left[0].pid) or psutil.Process(init.left[0].pid).status() == "zombie"


def test_other_failures_are_raised_at_once(monkeypatch):
    init = SlowNode(failures=1, error="port 6379 in use")
    monkeypatch.setattr(cluster.ray, "init", init)
    with pytest.raises(Exception, match="port 6379 in use"):
        start_local_ray(address="local")
    assert len(init.calls) == 1
    init.left[0].kill()


def test_the_tries_are_bounded(monkeypatch):
    init = SlowNode(failures=LOCAL_START_TRIES)
    monkeypatch.setattr(cluster.ray, "init", init)
    with pytest.raises(Exception, match=NODE_START_TIMEOUT):
        start_local_ray(address="local")
    assert len(init.calls) == LOCAL_START_TRIES
    for proc in init.left:  # the last try's leftovers too
        proc.wait(timeout=10)
