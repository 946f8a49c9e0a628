"""A SIGTERM sent to a run's whole process group (`kill -TERM -<pgid>`, like a plain `scancel` or systemd's stop)
stops the Ray processes the run started as well as the controller: nothing can be saved then. The controller says so
within seconds, with the checkpoint a re-run resumes from, and ends with status 4, instead of Ray's driver waiting a
minute for its GCS and then ending the process with Ray's own message.

The controller here is a real local Ray instance (`RayCluster`) and a real `RunCheckpoints` holding a committed
step, in a process of its own session; a step is "in flight" (a sleep) when the group is signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CONTROLLER = """
import sys, time
from mrl.app.checkpointing import RunCheckpoints
from mrl.config import validate_tree
from mrl.distributed.cluster import RayCluster

cfg = validate_tree({"checkpointing": {"dir": sys.argv[1]}, "run": {"output_dir": sys.argv[2]}})
checkpoints = RunCheckpoints(cfg, runtime=None)
tmp = checkpoints.manager.begin(3)
checkpoints.manager.commit(3, tmp, {})
RayCluster(num_cpus=1)
with checkpoints:
    print("in a step", flush=True)
    time.sleep(90)
print("the step ended", flush=True)
"""


def test_a_sigterm_to_the_whole_group_ends_the_run_at_once_naming_where_it_resumes(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(tmp_path / "ckpt"), str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "in a step"
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=45)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 4, out
    assert "the SIGTERM reached Ray's own processes too" in out and "no checkpoint could be saved" in out, out
    assert f"resumes from {tmp_path / 'ckpt' / 'step_3'}" in out and "scancel --batch --signal=TERM" in out, out
    assert "the step ended" not in out and took < 15, (took, out)
