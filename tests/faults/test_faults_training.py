"""Faults injected for real into whole runs of the command line (`make test-faults`), with what the run must do.

- A learning rate that overflows (1e30): the first update drives the weights so large that every later forward is
  inf/NaN. Each such step is skipped (no update, said on a line), `policy.max_nonfinite_steps` of them in a row
  stop the run with exit 3 and the fix; the checkpoints written hold finite weights, the skipped steps' equal to
  those of the last applied update.
- A policy rank stopped by SIGSTOP (a hang: the other rank waits for it in a collective): the call's deadline
  (`run.watchdog`) ends the run with exit 4, naming the group, the method and the late ranks, with the stopped
  rank's state and the waiting rank's Python stack, and where a re-run resumes; the re-run does.
- A full disk under `checkpointing.dir` (a 20 MB tmpfs: one checkpoint of the tiny model fits, a second does not):
  the save stops the run with exit 4 naming the folder, the reason and the free space; the partial folder is gone,
  the earlier checkpoint loads, and once there is room a re-run resumes from it and repeats the same losses.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from mrl.algorithms.guards import NONFINITE_EXIT_CODE
from mrl.app.errors import RUN_FAILED_EXIT_CODE
from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl, wait_for_file, worker_pids

SFT = ("sft", "--config", RECIPE, *SHORT_ARITH)


def _model_tensors(step_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint's distributed checkpoint, read in this process (torch's DCP converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir / "model"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _run(*args: str) -> tuple[int, str]:
    proc = mrl(*args)
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def test_an_overflowing_learning_rate_skips_its_updates_and_stops_the_run(tmp_path):
    code, out = _run(*SFT, f"run.output_dir={tmp_path}", "sft.max_num_steps=10", "checkpointing.save_every=1",
                     "checkpointing.keep_last=10", "policy.optimizer.lr=1e30")
    assert code == NONFINITE_EXIT_CODE, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    logged = metrics(tmp_path / "logs")
    skipped = [step for step, row in sorted(logged.items()) if row.get("train/nonfinite") == 1.0]
    limit = 3  # policy.max_nonfinite_steps' default
    assert len(skipped) == limit and skipped == list(range(skipped[0], skipped[0] + limit)), logged
    first, last = skipped[0], skipped[-1]
    assert first >= 2 and all(logged[s]["train/nonfinite"] == 0.0 for s in range(1, first)), logged
    assert f"steps {first}..{last}: the loss" in out and "lower policy.optimizer.lr" in out, out[-3000:]
    assert out.count("its update was skipped") == limit
    assert logged[last]["train/nonfinite_steps"] == limit
    checkpoints = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert checkpoints == list(range(1, last)), checkpoints  # the last skipped step stops before its save
    applied = _model_tensors(tmp_path / "checkpoints" / f"step_{first - 1}", tmp_path)
    for step in range(first, last):
        saved = _model_tensors(tmp_path / "checkpoints" / f"step_{step}", tmp_path)
        assert saved.keys() == applied.keys()
        for name, value in saved.items():
            assert torch.isfinite(value).all(), (step, name)
            assert torch.equal(value, applied[name]), (step, name)


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MB tmpfs (root and mount(2) needed: skips in one line elsewhere); unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip() or 'not root'})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_save_with_the_free_space_and_a_rerun_resumes(tmp_path, small_disk):
    ckpt = small_disk / "checkpoints"
    args = (*SFT, f"run.output_dir={tmp_path / 'run'}", "sft.max_num_steps=6", "checkpointing.save_every=2",
            "checkpointing.keep_last=1", f"checkpointing.dir={ckpt}")
    code, out = _run(*args)
    assert code == RUN_FAILED_EXIT_CODE, out[-3000:]
    message = out[out.index("mrl: run failed:"):]
    assert f"could not write checkpoint step 4 under {ckpt}: No space left on device" in message, message
    assert "free of 21.0 MB" in message and f"the newest checkpoint is {ckpt / 'step_2'}" in message, message
    assert "Traceback" not in message, message
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2"]  # the partial step 4 was removed
    first = metrics(tmp_path / "run" / "logs")
    assert all(torch.isfinite(v).all() for v in _model_tensors(ckpt / "step_2", tmp_path).values())

    subprocess.run(["mount", "-o", "remount,size=40m", str(small_disk)], check=True)  # room for two
    rerun = finish(mrl(*args))
    assert f"resuming from {ckpt / 'step_2'}" in rerun
    again = metrics(tmp_path / "run" / "logs")
    assert sorted(again) == list(range(1, 7)) and sorted(p.name for p in ckpt.iterdir()) == ["step_6"]
    for step in (3, 4):  # re-done after the resume, exactly
        assert again[step]["train/loss"] == first[step]["train/loss"], (step, again[step], first[step])


def test_a_stopped_policy_rank_is_a_hang_that_its_deadline_names_with_the_stacks(tmp_path):
    args = (*SFT, f"run.output_dir={tmp_path}", "sft.max_num_steps=12", "checkpointing.save_every=4",
            "cluster.devices_per_node=2", "policy.train_micro_batch_size=64",
            "+run.watchdog.overrides={train: 15, save: 15, logprobs: 15}")
    proc = mrl(*args)
    marker = tmp_path / "checkpoints" / "step_4" / "COMPLETE"
    wait_for_file(proc, marker)
    ranks = worker_pids(proc.pid)  # the policy's two ranks (SFT starts no engine)
    assert len(ranks) == 2, ranks
    os.kill(ranks[0], signal.SIGSTOP)
    stopped = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    detected = time.monotonic() - stopped
    assert proc.returncode == RUN_FAILED_EXIT_CODE, out[-3000:]
    message = out[out.index("mrl: run failed:"):]
    assert "worker group 'policy': '" in message and "did not finish within 15 s on ranks [" in message, message
    assert f"pid {ranks[0]}) ---\nno stack: the process is stopped" in message, message
    # The other rank is late too when the SIGSTOP caught the stopped one before a collective of the step (it waits
    # in it: its stack is shown); when it caught it after the step's last collective, the other finished the call
    # and is not named. Which one is a race with the step; a live rank's stack in a collective is checked
    # deterministically in tests/functional/distributed/test_distributed_worker_group.py.
    shown = dict(re.findall(r"--- stack of rank \d+ \(node [^,]+, pid (\d+)\) ---\n(.*?)(?=\n--- stack|\n  the newest)",
                            message, flags=re.S))
    assert shown.keys() in ({str(ranks[0])}, {str(ranks[0]), str(ranks[1])}), message
    if str(ranks[1]) in shown:
        assert "most recent call first" in shown[str(ranks[1])], message
    assert "Traceback" not in message and "resumes from it" in message, message
    newest = max(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert f"the newest checkpoint is {tmp_path / 'checkpoints' / f'step_{newest}'}" in message
    assert detected < 15 + 30, detected  # the deadline, the stacks, the shutdown
    print(f"hang detected and the run ended {detected:.1f} s after the SIGSTOP (deadline 15 s)")
    rerun = finish(mrl(*args[:-1], "+run.watchdog.overrides={train: 600}"))
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{newest}'}" in rerun
    assert max(metrics(tmp_path / "logs")) == 12
