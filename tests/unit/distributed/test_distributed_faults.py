"""Named fault points (mrl/distributed/faults.py): a process dies by SIGKILL at the configured pass of a point, once
per marker file, and nowhere else."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from mrl.distributed.faults import ENV, _parse

PASSES = """
import sys
from mrl.distributed.faults import inject
for i in range(1, 6):
    inject("engine.refit_bucket")
    inject("engine.generate")
    print(i, flush=True)
"""


def _run(spec: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PASSES], env={ENV: spec, "PATH": ""}, capture_output=True, text=True,
                          timeout=60)


def test_the_process_dies_by_sigkill_at_the_named_pass_and_writes_where(tmp_path):
    marker = tmp_path / "killed"
    done = _run(f"engine.generate@3:{marker}")
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.split() == ["1", "2"]  # passes 1 and 2 of engine.generate went by
    where = json.loads(marker.read_text())
    assert (where["point"], where["hit"]) == ("engine.generate", 3) and where["pid"] > 0


def test_a_fault_fires_once_so_a_replacement_process_lives(tmp_path):
    marker = tmp_path / "killed"
    assert _run(f"engine.generate@1:{marker}").returncode == -signal.SIGKILL
    again = _run(f"engine.generate@1:{marker}")  # a new process counts from zero, but the marker exists
    assert again.returncode == 0 and again.stdout.split() == ["1", "2", "3", "4", "5"]


def test_unset_or_other_points_do_nothing(tmp_path):
    assert _run("").returncode == 0
    assert _run(f"engine.other@1:{tmp_path / 'x'}").returncode == 0 and not (tmp_path / "x").exists()


def test_a_malformed_spec_names_the_form():
    with pytest.raises(ValueError, match=r"<point>@<hit>:<marker file>"):
        _parse("engine.generate:3")


def test_a_worker_registers_its_role_and_pid_only_where_a_campaign_asks(tmp_path, monkeypatch):
    import os

    from mrl.distributed.faults import PIDS_ENV, register

    monkeypatch.delenv(PIDS_ENV, raising=False)
    register("PolicyWorker")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(PIDS_ENV, str(tmp_path / "pids"))
    register("PolicyWorker")
    assert [p.name for p in (tmp_path / "pids").iterdir()] == [f"PolicyWorker-{os.getpid()}"]
