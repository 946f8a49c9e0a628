#!/usr/bin/env python
"""Crash/resume trials: kill a GRPO run with SIGKILL at random moments (one of them while a checkpoint is being
written), re-run the same command, and check that every step after the resumed checkpoint logs exactly the metrics of
an uninterrupted run with the same seed.

    python benchmarks/crash_resume_trials.py [--trials 5] [--steps 8] [--seed 0] [--out results/crash_resume]

The run is the embedded recipe shortened (mrl.testing.runs.SHORT_ARITH: 1-digit addition), started from a short SFT
warm-up so that GRPO has a reward signal. Prints one line per trial and a final verdict; exits 1 on any mismatch.
Compared: every `train/*` metric except wall-clock times (bit-exact equality, CPU fp32).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

from mrl.testing.runs import MACHINERY, RECIPE, SHORT_ARITH, finish, metrics, mrl


def _grpo_args(model: Path, out: Path, steps: int) -> list[str]:
    return ["grpo", "--config", RECIPE, *SHORT_ARITH, f"policy.model_name={model}", "~policy.build",
            f"grpo.max_num_steps={steps}", "grpo.max_num_epochs=100", "grpo.val_every=0", *MACHINERY,
            "checkpointing.save_every=2", "checkpointing.keep_last=2", f"run.output_dir={out}"]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("train/") and "time" not in k}


def _kill_when(proc, out: Path, after_step: int, delay_s: float, during_write: bool) -> str:
    """SIGKILL the run's process group `delay_s` after step `after_step` was logged, or (during_write) while a
    checkpoint after the first one is being written."""
    ckpt, log = out / "checkpoints", out / "logs" / "metrics.jsonl"
    logged_at = None
    while proc.poll() is None:
        entries = [p.name for p in ckpt.iterdir()] if ckpt.is_dir() else []
        # a write in progress while an earlier checkpoint is complete: the resume must skip the half-written one
        writing = any(n.startswith(".tmp-") for n in entries) and any(n.startswith("step_") for n in entries)
        steps = len(log.read_text().splitlines()) - 1 if log.exists() else 0  # line 0 is the step-0 validation
        if logged_at is None and steps >= after_step:
            logged_at = time.monotonic()
        if (during_write and writing) or (not during_write and logged_at and time.monotonic() - logged_at >= delay_s):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "during a checkpoint write" if writing else f"{delay_s:.2f} s after step {after_step}"
        time.sleep(0.01)
    return "never (the run finished first)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/crash_resume")
    args = parser.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(args.seed)

    print("SFT warm-up ...", flush=True)
    finish(mrl("sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={root / 'sft'}"))
    model = root / "sft" / "final_hf"
    print("uninterrupted reference run ...", flush=True)
    start = time.monotonic()
    finish(mrl(*_grpo_args(model, root / "reference", args.steps)))
    duration = time.monotonic() - start
    reference = metrics(root / "reference" / "logs")

    failures = 0
    for trial in range(args.trials):
        out = root / f"trial{trial}"
        during_write = trial == 0
        proc = mrl(*_grpo_args(model, out, args.steps))
        when = _kill_when(proc, out, rng.randint(1, args.steps - 1), rng.uniform(0.0, 0.6), during_write)
        text = finish(mrl(*_grpo_args(model, out, args.steps)))
        resumed_from = next((line.split("step ")[-1].rstrip(")") for line in text.splitlines()
                             if "resuming from" in line), "none (fresh start)")
        got = metrics(out / "logs")
        first = int(resumed_from) + 1 if resumed_from.isdigit() else 1
        steps = range(first, args.steps + 1)
        bad = [s for s in steps if _comparable(got[s]) != _comparable(reference[s])]
        failures += bool(bad)
        print(f"trial {trial}: killed {when}; resumed from step {resumed_from}; steps {first}..{args.steps} "
              f"{'EXACT' if not bad else f'DIFFER at {bad}'}", flush=True)
    print(f"{args.trials - failures}/{args.trials} trials resumed exactly (reference run {duration:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
