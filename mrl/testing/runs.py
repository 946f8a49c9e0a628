"""Running `mrl` commands as a user would (a subprocess of the real CLI), for the end-to-end tests.

`SHORT_ARITH` shortens the embedded recipe to a 1-digit task that trains in seconds: 150 SFT steps leave a policy
that is partly right, so GRPO groups carry a reward signal and the weights really move.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "arith-tiny-cpu.yaml")
SHORT_ARITH = (
    "data.arith.digits=1",
    "data.arith.num_heldout=20",
    "sft.max_num_steps=150",
    "grpo.max_num_steps=4",
    "grpo.max_num_epochs=4",
    "grpo.val_every=2",
    "eval.num_samples=2",
    "eval.pass_k=[1,2]",
    "policy.max_total_sequence_length=12",
    "generation.max_new_tokens=4",
    "generation.vllm.max_model_len=12",
    "logger.log_every=1",
)
#: For runs that check machinery (hub, faults, engines, benchmarks) from a model that need not learn: a random model's
#: groups may all score alike for 3 steps, which the default grpo.max_idle_steps (3) stops with exit 2.
MACHINERY = ("grpo.max_idle_steps=0",)


def mrl(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python -m mrl.cli ARGS` in its own session (so a test can kill it with every Ray process it started);
    `env` adds to this process's environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "mrl.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )


def run_streamed(args: list[str], timeout_s: float) -> tuple[int, str, float]:
    """`mrl ARGS` (`mrl`: its own session, killed with every Ray process it started after `timeout_s`): exit
    status, output, seconds. The output is printed line by line as it comes (pytest -s), so a run cut from outside
    (a GPU session's stage limit) still shows how far it got."""
    start = time.perf_counter()
    proc = mrl(*args, env={"PYTHONUNBUFFERED": "1"})
    killer = threading.Timer(timeout_s, os.killpg, args=(proc.pid, signal.SIGKILL))
    killer.start()
    lines = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]  # Popen(stdout=PIPE)
            print(line, end="", flush=True)
            lines.append(line)
        proc.wait()
    finally:
        killer.cancel()
    if proc.returncode == -signal.SIGKILL:
        lines.append(f"\n[mrl.testing.runs] killed after {timeout_s} s")
    return proc.returncode, "".join(lines), time.perf_counter() - start


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """Wait for the command; its combined output. A non-zero exit fails with the output's tail."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"mrl exited with {proc.returncode}:\n{out[-4000:]}")
    return out


def metrics(log_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (re-run after a resume) keeps its last record."""
    rows = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def warm_grpo_args(warm: Path, out: Path, *extra: str) -> list[str]:
    """GRPO on the short task from a warm policy (an SFT run's HF folder), a checkpoint every step, no validation
    until the end, a learning rate at which the weights visibly move: the fault tests' run, `extra` appended."""
    return [
        "grpo",
        "--config",
        RECIPE,
        *SHORT_ARITH,
        f"policy.model_name={warm}",
        "~policy.build",
        "checkpointing.save_every=1",
        "grpo.val_every=0",
        f"run.output_dir={out}",
        "policy.optimizer.lr=1e-3",
        *extra,
    ]


class Uninterrupted:
    """A run started now and waited for when its metrics are first asked for: the uninterrupted reference that
    several fault tests compare against, run once and alongside the first test's own run."""

    def __init__(self, args: list[str], out: Path) -> None:
        self.out = out
        self._proc = mrl(*args)
        self._metrics: dict[int, dict] | None = None

    def metrics(self) -> dict[int, dict]:
        if self._metrics is None:
            finish(self._proc)
            self._metrics = metrics(self.out / "logs")
        return self._metrics


def training_metrics(row: dict, *, skip: tuple[str, ...] = ()) -> dict:
    """A step's `train/*` metrics that an interrupted run must reproduce: all but wall times, restart counts and any
    key holding one of `skip`."""
    return {
        k: v
        for k, v in row.items()
        if k.startswith("train/") and "time" not in k and "restarts" not in k and not any(word in k for word in skip)
    }


def wait_for_file(proc: subprocess.Popen, path: Path, timeout_s: float = 300) -> None:
    """Wait until `path` exists (e.g. a checkpoint's COMPLETE marker) while `proc` runs; fail with its output's tail
    if it ends first or the time runs out."""
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), proc.communicate()[0][-3000:]


def worker_pids(driver_pid: int) -> list[int]:
    """The Ray actor processes hosting worker ranks (titled `ray::WorkerHost...`) among the driver's descendants,
    in the order psutil lists them."""
    import psutil

    try:
        children = psutil.Process(driver_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if "WorkerHost" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            continue
    return found
