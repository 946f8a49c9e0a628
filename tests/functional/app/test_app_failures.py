"""What a user meets when things go wrong or are left out, through the real command line.

- a policy worker killed mid-run: one message naming the group, rank and method, where the newest checkpoint is and
  that re-running the same command resumes, exit status 4; re-running it does resume;
- GRPO without validation data: validation is skipped (said once), the run completes;
- checkpointing.enabled=false: nothing is written under checkpointing.dir (the final HF export still is).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from mrl.app.errors import RUN_FAILED_EXIT_CODE
from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl, wait_for_file, worker_pids


def test_a_dead_policy_worker_ends_the_run_with_one_message_and_a_rerun_resumes(tmp_path):
    args = ["sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={tmp_path}", "sft.max_num_steps=30",
            "checkpointing.save_every=10"]
    proc = mrl(*args)
    marker = tmp_path / "checkpoints" / "step_10" / "COMPLETE"
    wait_for_file(proc, marker)
    workers = worker_pids(proc.pid)  # SFT starts the policy's one rank, no engine
    assert len(workers) == 1, workers
    worker = workers[0]
    os.kill(worker, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == RUN_FAILED_EXIT_CODE, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "worker group 'policy' rank 0" in out and "died while running 'train'" in out, out[-3000:]
    newest = max(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert f"the newest checkpoint is {tmp_path / 'checkpoints' / f'step_{newest}'}" in out, out[-3000:]
    assert "resumes from it" in out
    rerun = finish(mrl(*args))
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{newest}'}" in rerun
    assert max(metrics(tmp_path / "logs")) == 30


def test_grpo_without_validation_data_and_without_checkpoints(tmp_path):
    """Starts from a 1-digit SFT model made here (5 steps); prompts come from a file (no held-out set, no eval.data)."""
    sft_dir, out = tmp_path / "sft", tmp_path / "grpo"
    finish(mrl("sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={sft_dir}", "checkpointing.enabled=false",
               "sft.max_num_steps=5"))  # a model folder to start from; what it learned does not matter here
    assert not (sft_dir / "checkpoints").exists() and (sft_dir / "final_hf" / ".complete").is_file()
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"problem": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                             for a in range(10) for b in range(10)))
    text = finish(mrl("grpo", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={out}", "~data.arith",
                      f"data.train={train}", f"policy.model_name={sft_dir / 'final_hf'}", "~policy.build",
                      "grpo.max_num_steps=2", "checkpointing.enabled=false"))
    assert text.count("validation is skipped") == 1
    logged = metrics(out / "logs")
    assert sorted(logged) == [1, 2] and not any(k.startswith("val/") for row in logged.values() for k in row)
    assert not (out / "checkpoints").exists()
    assert (out / "final_hf" / ".complete").is_file()
    assert json.loads((out / "summary.json").read_text())["val_accuracy_before"] is None
