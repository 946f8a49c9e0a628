"""The fault campaign's clock (mrl/testing/fault_campaign.py): a kind's life is measured from the pids its processes
register, and a trial's fault waits for its kind's first process. Real child processes that register as a worker
would (mrl.distributed.faults.register), with lives set by the test."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mrl.distributed.faults import PIDS_ENV
from mrl.testing.fault_campaign import _first_start, observe

# A process that is a VerifierActor from 0.5 s to 2.0 s of its run, then a plain process until 2.5 s, then exits.
CHILD = """
import os, sys, time
from mrl.distributed.faults import register
time.sleep(0.5)
pid = os.fork()
if pid == 0:
    register("VerifierActor")
    time.sleep(1.5)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.5)
print("done")
"""


def _start(tmp_path, code: str) -> subprocess.Popen:
    env = {**os.environ, PIDS_ENV: str(tmp_path / "pids")}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def test_observe_measures_each_kind_from_its_first_start_to_its_last_sight(tmp_path):
    out, lives = observe(_start(tmp_path, CHILD), tmp_path / "pids")
    assert "done" in out
    assert set(lives) == {"verifier"}  # the kinds that never registered are absent
    assert 1.0 < lives["verifier"] < 2.0, lives  # 1.5 s alive, sampled every 0.2 s


def test_observe_fails_with_the_output_of_a_command_that_fails(tmp_path):
    with pytest.raises(AssertionError, match="exited with 3"):
        observe(_start(tmp_path, "import sys; print('oops'); sys.exit(3)"), tmp_path / "pids")


def test_a_trial_waits_for_its_kinds_first_process_and_not_past_the_commands_end(tmp_path):
    proc = _start(tmp_path, CHILD)
    start = time.monotonic()
    pid = _first_start("verifier", proc, tmp_path / "pids", timeout_s=30)
    assert pid is not None and pid != proc.pid and 0.4 < time.monotonic() - start < 2.0
    assert _first_start("engine", proc, tmp_path / "pids", timeout_s=30) is None  # the command ends first
    assert proc.wait(timeout=10) == 0
