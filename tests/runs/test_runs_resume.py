"""Resume through the command line with SFT (no engine: fast): SIGTERM saves and exits 0, and a checkpoint written
at TP1 resumes at TP2 with the losses the uninterrupted TP1 run has (<= 1e-5)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl


def _sft(out: Path, *extra: str) -> list[str]:
    return ["sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={out}", *extra]


def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path):
    proc = mrl(*_sft(tmp_path, "sft.max_num_steps=100000", "checkpointing.save_every=100000"))
    log = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while (not log.exists() or len(log.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc, timeout=60)
    assert time.monotonic() - sent < 60
    assert "SIGTERM" in out and "pre-empted" in out
    assert not (tmp_path / "final_hf").exists() and not (tmp_path / "summary.json").exists()  # not finished
    last = max(metrics(tmp_path / "logs"))
    saved = json.loads((tmp_path / "checkpoints" / f"step_{last}" / "COMPLETE").read_text())
    assert saved["step"] == last


def test_tp1_checkpoint_resumes_at_tp2_with_the_same_losses(tmp_path):
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    started = [mrl(*_sft(reference_dir, "sft.max_num_steps=4", "checkpointing.save_every=2")),
               mrl(*_sft(resumed_dir, "sft.max_num_steps=2", "checkpointing.save_every=2"))]  # side by side
    for proc in started:
        finish(proc)
    out = finish(mrl(*_sft(resumed_dir, "sft.max_num_steps=4", "checkpointing.save_every=2",
                           "cluster.devices_per_node=2", "policy.parallel.tensor_parallel_size=2")))
    assert "resuming from" in out and "step_2" in out
    reference, resumed = metrics(reference_dir / "logs"), metrics(resumed_dir / "logs")
    for step in (3, 4):
        assert abs(resumed[step]["train/loss"] - reference[step]["train/loss"]) <= 1e-5, (step, reference, resumed)
