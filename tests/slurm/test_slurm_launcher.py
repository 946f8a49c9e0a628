"""The launcher on a real Slurm: `mrl submit` checks the config, sbatch runs slurm/ray-sbatch.sh, the Ray cluster
forms, the staged tiny recipe (SFT -> GRPO -> eval) runs on it; a second run pre-empted during GRPO with
`scancel --batch --signal=TERM` saves, is re-queued by the launcher and resumes, and logs exactly the metrics of the
uninterrupted run. On two nodes (the second in a network namespace), data-parallel SFT across the nodes logs the
losses of the same layout on one machine. The container mode's commands are checked as text (no container runtime
exists here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mrl.testing.runs import RECIPE, SHORT_ARITH, metrics

ROOT = Path(__file__).resolve().parents[2]
WALL_CLOCK = ("timing/", "train/time_s")  # and "time": fields that differ between any two runs


# GRPO long enough (20 steps of ~0.5 s) for the pre-emption to land inside it.
LONGER_GRPO = ("grpo.max_num_steps=20", "grpo.max_num_epochs=20", "grpo.val_every=10")


def _submit(env: dict, out: Path, logs: Path, *flags: str) -> str:
    command = [sys.executable, "-m", "mrl.cli", "submit", "--no-gpus", "--log-root", str(logs), *flags, "--",
               "mrl", "run", RECIPE, *SHORT_ARITH, *LONGER_GRPO, f"run.output_dir={out}"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _job_state(env: dict, job: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    fields = dict(part.split("=", 1) for part in shown.split() if "=" in part)
    return fields.get("JobState", "GONE")


def _wait(env: dict, job: str, timeout_s: float = 900, until=None) -> str:
    """Wait until the job has ended (or `until()` is true); its last state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _job_state(env, job)
        if until is not None and until():
            return state
        if until is None and state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "GONE"):
            return state
        time.sleep(1)
    raise AssertionError(f"job {job} still {_job_state(env, job)} after {timeout_s} s")


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not (k.startswith(WALL_CLOCK) or k == "time")}


def _output(logs: Path, job: str) -> str:
    return (logs / f"slurm-{job}.out").read_text()


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> Path:
    out, logs = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("reference-logs")
    job = _submit(slurm, out, logs)
    state = _wait(slurm, job)
    assert state == "COMPLETED", _output(logs, job) + (logs / job / "driver.log").read_text()[-3000:]
    assert "all 1 node(s) joined the Ray cluster" in _output(logs, job)
    return out


def test_a_run_through_the_launcher(uninterrupted):
    grpo = metrics(uninterrupted / "grpo" / "logs")
    assert sorted(grpo) == list(range(21))
    assert all(grpo[step]["train/token_mult_prob_error"] <= 1.001 for step in range(1, 21))
    assert (uninterrupted / "eval" / "samples.jsonl").is_file()


def test_preempted_run_is_requeued_and_resumes_exactly(slurm, uninterrupted, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    job = _submit(slurm, out, logs, "--requeue")
    grpo_log = out / "grpo" / "logs" / "metrics.jsonl"
    _wait(slurm, job, until=lambda: grpo_log.is_file() and len(grpo_log.read_text().splitlines()) >= 3)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, env=slurm)
    _wait(slurm, job, until=lambda: (logs / f"{job}.1").is_dir())  # the launcher re-queued it: restart 1
    state = _wait(slurm, job)
    text = _output(logs, job)
    assert state == "COMPLETED", text + (logs / f"{job}.1" / "driver.log").read_text()[-3000:]
    assert "pre-empted: re-queueing job" in text
    first = (logs / job / "driver.log").read_text()
    assert "SIGTERM" in first and "pre-empted" in first and "stage 3/3" not in first  # stopped inside GRPO
    assert "resuming from" in (logs / f"{job}.1" / "driver.log").read_text()
    reference, resumed = metrics(uninterrupted / "grpo" / "logs"), metrics(out / "grpo" / "logs")
    assert sorted(resumed) == sorted(reference)
    for step in reference:
        assert _comparable(resumed[step]) == _comparable(reference[step]), step


SFT_DP2 = ("data.arith.digits=1", "data.arith.num_heldout=20", "sft.max_num_steps=8",
           "policy.train_micro_batch_size=64", "policy.max_total_sequence_length=12", "logger.log_every=1",
           "checkpointing.enabled=false")


def test_two_nodes_train_like_one(two_node_slurm, tmp_path):
    """SFT with DP2: one rank on each node through the launcher, and both ranks on this machine without Slurm."""
    from mrl.testing.runs import finish, mrl

    out, logs = tmp_path / "two-nodes", tmp_path / "logs"
    command = [sys.executable, "-m", "mrl.cli", "submit", "--no-gpus", "--log-root", str(logs), "--", "mrl", "sft",
               "--config", RECIPE, *SFT_DP2, "cluster.num_nodes=2", "cluster.devices_per_node=1",
               f"run.output_dir={out}"]
    done = subprocess.run(command, cwd=ROOT, env=two_node_slurm, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    state = _wait(two_node_slurm, job)
    assert state == "COMPLETED", _output(logs, job) + (logs / job / "driver.log").read_text()[-3000:]
    assert "all 2 node(s) joined the Ray cluster" in _output(logs, job)
    finish(mrl("sft", "--config", RECIPE, *SFT_DP2, "cluster.devices_per_node=2", f"run.output_dir={tmp_path / 'one'}"))
    two, one = metrics(out / "logs"), metrics(tmp_path / "one" / "logs")
    assert sorted(two) == sorted(one) == list(range(1, 9))
    for step in one:
        assert abs(two[step]["train/loss"] - one[step]["train/loss"]) <= 1e-6, step


def test_preflight_refuses_an_allocation_that_does_not_fit_the_config(slurm, tmp_path):
    command = [sys.executable, "-m", "mrl.cli", "submit", "--nodes", "2", "--no-gpus", "--log-root", str(tmp_path),
               "--", "mrl", "grpo", "--config", RECIPE]
    done = subprocess.run(command, cwd=ROOT, env=slurm, capture_output=True, text=True)
    assert done.returncode == 2 and "--nodes 2 but cluster.num_nodes=1" in done.stderr
    queued = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=slurm).stdout
    assert queued.strip() == ""  # nothing was submitted
    bad = [*command[:4], "--", "mrl", "grpo", "--config", RECIPE, "grpo.no_such_key=1"]
    done = subprocess.run(bad, cwd=ROOT, env=slurm, capture_output=True, text=True)
    assert done.returncode == 2 and "grpo.no_such_key" in done.stderr


def test_container_mode_commands(tmp_path):
    """The launcher's commands with MRL_CONTAINER_IMAGE, printed (MRL_DRY_RUN=1) with a stand-in `scontrol`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node1\\nnode2\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node[1-2]",
               SLURM_SUBMIT_DIR=str(tmp_path), SLURM_GPUS_PER_NODE="8", MRL_DRY_RUN="1",
               MRL_CONTAINER_IMAGE="nvcr.io/org/mrl:1", MRL_CONTAINER_MOUNTS="/lustre:/lustre")
    done = subprocess.run(["bash", str(ROOT / "slurm" / "ray-sbatch.sh"), "mrl", "grpo", "--config", "x.yaml"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("+ srun")]
    # the user's mounts and the submit folder, which every step runs in (slurm/ray-sbatch.sh with_submit_dir)
    image = f"--container-image=nvcr.io/org/mrl:1 --container-mounts=/lustre:/lustre,{tmp_path}:{tmp_path} "
    assert all(image in line for line in lines) and len(lines) == 4  # head, worker, wait, driver

    def one(*parts: str) -> str:
        (found,) = [line for line in lines if all(part in line for part in parts)]
        return found

    one("-w node1", "ray start --head", "--port=6379", "--num-gpus=8", "--min-worker-port=6479", "--block")
    one("-w node2", "ray start --address=HEAD_IP:6379", "--num-gpus=8")
    one("-w node1", "mrl.app.slurm wait-for-nodes", "--nodes node1 node2")
    assert one("-w node1", "RAY_ADDRESS=HEAD_IP:6379").endswith("mrl grpo --config x.yaml")
